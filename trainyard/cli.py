"""`trainyard`: the command line on top of the SDK (`trainyard.Client`), SPEC §5.

It talks to the platform only over HTTP and never imports Django, so it starts fast on a laptop and
installs without the server. The manifest rules are this package's own (`trainyard.manifest`), and the
server validates submissions with the same module, so `trainyard validate` and the check before every
upload give the same verdict as a submission.

Every failure is one line on stderr, never a traceback, with an exit code scripts can rely on:
0 ok, 1 the job failed or the server said no (or could not be reached), 2 a usage or local problem
(bad manifest, bad code directory, missing configuration).
"""
import argparse
import getpass
import json
import os
import re
import sys

from trainyard import overrides, sso
from trainyard.client import Client, read_manifest_file
from trainyard.config import Config, config_path, normalize_url, save_config
from trainyard.errors import TrainyardError, UsageError
from trainyard.experiment import ExperimentDocument, parse_experiment
from trainyard.manifest import ManifestError, json_schema, load_fields, parse_manifest
from trainyard.packing import code_upload
from trainyard.render import (QUOTA_ROWS, Progress, comparison_rows, final_message, for_terminal, human_bytes, isatty,
                              local_time, note, number, print_json, print_table, quota_value, render_allocations,
                              render_job)

OK, FAILED, USAGE = 0, 1, 2


def exit_code(error):
    """2 for a problem on this side (configuration, code, manifest), 1 for everything else."""
    return USAGE if isinstance(error, UsageError) else FAILED


def _client():
    return Client(notify=note)


def _read_manifest(path, changes=()):
    """The manifest file's bytes (with `changes`, (path, value) pairs from --set and --name, applied) and
    the Manifest they make; UsageError naming every problem."""
    if os.path.isdir(path):
        raise UsageError(f"{path}: is a folder, not a manifest (the job's YAML file); `trainyard train` takes "
                         "the manifest first, then the code: trainyard train MANIFEST CODE_DIR_OR_ARCHIVE")
    text = read_manifest_file(path)
    try:
        text = overrides.overridden(text, changes)
        return text, parse_manifest(text)
    except ManifestError as exc:
        raise _invalid(f"{path}{' with --set/--name' if changes else ''}: invalid manifest", exc) from None


def _invalid(what, error):
    """UsageError for a manifest that broke rules: one on the line, several one a line below it."""
    problems = error.problems
    shown = f" {error}" if len(problems) == 1 else "".join(f"\n  {problem}" for problem in problems)
    return UsageError(f"{what}:{shown}")


def _read_experiment(path):
    """The experiment manifest's bytes and the Experiment they make; UsageError naming every problem."""
    text = read_manifest_file(path)
    try:
        return text, parse_experiment(text)
    except ManifestError as exc:
        raise _invalid(f"{path}: invalid experiment manifest", exc) from None


def _job_id(client, value):
    """The whole id of the job `value` names: its id, or the start of one (`training-5o2`, `5o2`)."""
    value = value.strip()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", value):
        raise UsageError(f"{value!r} is not a job id (they look like training-ab12cd34)")
    return client.resolve_job_id(value)


# --- commands --------------------------------------------------------------------------------------
def cmd_validate(args):
    if _is_experiment(args.manifest):
        _, experiment = _read_experiment(args.manifest)
        searcher = experiment.searcher
        varied = ", ".join(hp.name for hp in experiment.varied())
        print(f"{args.manifest}: ok — experiment {experiment.name}: {searcher.name} search over {varied} for the "
              f"{'lowest' if searcher.smaller_is_better else 'highest'} {searcher.metric}, at most "
              f"{searcher.max_trials} trials, {searcher.max_concurrent_trials} at once")
        return OK
    _, manifest = _read_manifest(args.manifest)
    learners = f"{manifest.learners} learner{'s' if manifest.learners != 1 else ''}"
    print(f"{args.manifest}: ok — {manifest.name}: {manifest.framework} {manifest.framework_version}".rstrip()
          + f", {learners} × {manifest.gpus} GPU, {manifest.cpus:g} CPU, {human_bytes(manifest.memory_bytes)}")
    # What an FfDL manifest (or an FfDL name) was mapped to, so nothing is translated silently.
    for note_text in manifest.notes:
        print(f"  mapped: {note_text}")
    return OK


def cmd_schema(args):
    print(json.dumps(json_schema(ExperimentDocument if args.experiment else None), indent=2))
    return OK


def _upload(send, manifest_bytes, code):
    """`send(manifest_bytes, upload, on_progress=...)` with the code packed (a folder) or opened (an
    archive), its progress shown on a terminal; what the server answered."""
    upload = code_upload(code, warn=note)
    try:
        progress = Progress(f"uploading {upload.filename} ({human_bytes(upload.size)})")
        try:
            return send(manifest_bytes, upload, on_progress=progress.update)
        finally:
            progress.clear()
    finally:
        upload.fileobj.close()


def cmd_train(args):
    changes = overrides.pairs(args.set, name=args.name)
    manifest_bytes, _ = _read_manifest(args.manifest, changes)  # checked here first: no upload of a bad manifest
    client = _client()
    job = _upload(client.submit_upload, manifest_bytes, args.code)
    if args.json:
        print_json(job)
    else:
        print(job["id"], flush=True)
    if isatty(sys.stderr) and not args.follow:
        note(f"submitted {job['id']} ({job.get('status')}); follow it with `trainyard logs {job['id']} --follow`")
    if not args.follow:
        return OK
    try:
        print_logs(client.log_pages(job["id"], follow=True), show_learner=job.get("learners", 1) > 1)
    except KeyboardInterrupt:
        note(f"\nstopped following; {job['id']} keeps running (`trainyard logs {job['id']} --follow`)")
        return 130
    final = client.job(job["id"])
    note(final_message(final))
    return OK if final.get("status") == "COMPLETED" else FAILED


def _is_experiment(path):
    """Whether the manifest file has an experiment's sections (read leniently: the checks come after)."""
    try:
        fields = load_fields(read_manifest_file(path))
    except (UsageError, ManifestError):
        return False
    return "searcher" in fields or "hyperparameters" in fields


def cmd_experiment_create(args):
    manifest_bytes, _ = _read_experiment(args.manifest)  # checked here first: no upload of a bad one
    client = _client()
    experiment = _upload(client.create_experiment_upload, manifest_bytes, args.code)
    if args.json:
        print_json(experiment)
    else:
        print(experiment["id"], flush=True)
    if not args.wait:
        return OK
    final = client.wait_experiment(experiment["id"])
    note(_experiment_summary(final))
    return OK if final["state"] == "COMPLETED" else FAILED


def cmd_experiment_list(args):
    experiments = _client().experiments(state=args.state)
    if args.json:
        print_json(experiments)
        return OK
    print_table(("ID", "NAME", "SEARCHER", "STATE", "TRIALS", "BEST", "OWNER", "CREATED"),
                [(e["id"], e["name"], f"{e['searcher']} {e['metric']}", e["state"],
                  f"{e['trials_started']}/{e['max_trials']}", number(e["best_value"]) if e["best_value"] is not None
                  else "-", e["owner"], local_time(e["created_at"])) for e in experiments])
    return OK


def cmd_experiment_show(args):
    experiment = _client().experiment(args.id)
    if args.json:
        print_json(experiment)
        return OK
    print(_experiment_summary(experiment))
    names = [hp["name"] for hp in experiment["hyperparameters"]]
    best = experiment.get("best_trial")
    print_table(("TRIAL", "JOB", "STATE", "STATUS", *names, experiment["metric"].upper(), "STEP"),
                [(f"{t['number']}{' *' if t['number'] == best else ''}", t["job_id"], t["state"], t["job_status"],
                  *(number(t["params"].get(name)) for name in names),
                  number(t["value"]) if t["value"] is not None else "-", t["step"] if t["step"] is not None else "-")
                 for t in experiment["trials"]])
    return OK


def cmd_experiment_delete(args):
    return _delete(args, args.id, "and all its trials' jobs, with their code, results, checkpoints, logs and metrics",
                   _client().delete_experiment)


def cmd_experiment_action(args):
    client = _client()
    action = {"pause": client.pause_experiment, "resume": client.resume_experiment, "kill": client.kill_experiment}
    experiment = action[args.experiment_command](args.id)
    print(f"{experiment['id']}: {experiment['state']}")
    return OK


def _experiment_summary(experiment):
    best = (f"; best: trial {experiment['best_trial']} with {experiment['metric']} {number(experiment['best_value'])}"
            if experiment.get("best_trial") is not None else "")
    reason = f" ({experiment['state_reason']})" if experiment.get("state_reason") else ""
    return (f"{experiment['id']} {experiment['name']}: {experiment['state']}{reason}, {experiment['searcher']} search, "
            f"{experiment['trials_started']}/{experiment['max_trials']} trials{best}")


def print_logs(pages, *, show_learner):
    """Print each page of log lines as it comes (flushed per page: a follower sees lines live)."""
    for lines in pages:
        for line in lines:
            prefix = f"[learner {line.get('learner')}] " if show_learner else ""
            print(f"{prefix}{line.get('line', '')}")
        sys.stdout.flush()


def cmd_list(args):
    page = _client().get("/api/v1/jobs/", status=args.status, user=args.user, limit=args.limit)
    if args.json:
        print_json(page)
        return OK
    jobs = page.get("results") or []
    print_table(("ID", "NAME", "STATUS", "ATTEMPT", "RESOURCES", "OWNER", "CREATED"),
                [(j.get("id"), j.get("name", ""), j.get("status"), j.get("attempt"),
                  f"{j.get('learners', 1)}×{j.get('gpus', 0)}GPU", j.get("owner", ""), local_time(j.get("created_at")))
                 for j in jobs])
    if page.get("count", len(jobs)) > len(jobs):
        note(f"showing {len(jobs)} of {page['count']} jobs; use --limit for more")
    return OK


def cmd_show(args):
    client = _client()
    job = client.job(_job_id(client, args.id))
    timeline = client.allocations(job["id"]) if job.get("elastic") else None
    if args.json:
        print_json(job if timeline is None else dict(job, allocations=timeline))
        return OK
    print(render_job(job, client.url))
    if timeline:
        print()
        print(render_allocations(timeline))
    return OK


def cmd_logs(args):
    client = _client()
    job = client.job(_job_id(client, args.id))
    print_logs(client.log_pages(job["id"], since=args.since, follow=args.follow),
               show_learner=job.get("learners", 1) > 1)
    return OK


def cmd_metrics(args):
    client = _client()
    points = client.metrics(_job_id(client, args.id), name=args.name)
    if args.json:
        print_json(points)
        return OK
    if not points:
        note(f"{args.id} has no metrics yet")
        return OK
    rows = sorted(points, key=lambda p: (str(p.get("name")), p.get("step") if p.get("step") is not None else -1))
    print_table(("NAME", "STEP", "VALUE", "LEARNER", "TIME"),
                [(p.get("name"), "-" if p.get("step") is None else p["step"], number(p.get("value")),
                  p.get("learner", "-"), local_time(p.get("time"))) for p in rows])
    return OK


def cmd_compare(args):
    """The server decides how many jobs make a comparison (its 400 names the limit); ids are checked here."""
    client = _client()
    comparison = client.compare([_job_id(client, job_id) for job_id in args.ids])
    if args.json:
        print_json(comparison)
        return OK
    headers, rows, same = comparison_rows(comparison)
    print_table(headers, rows)
    if same:
        print(same)
    return OK


def cmd_action(args):
    client = _client()
    job = getattr(client, args.command)(_job_id(client, args.id))  # halt, resume or terminate
    print(f"{job.get('id')}: {job.get('status')}")
    return OK


def cmd_delete(args):
    client = _client()
    job_id = _job_id(client, args.id)
    return _delete(args, job_id, "with its code, results, checkpoints, logs and metrics", client.delete)


def _delete(args, name, what, delete):
    """Delete `name` once the person at the terminal says yes (or --yes says it for a script)."""
    if not args.yes:
        if not isatty(sys.stdin):
            raise UsageError(f"deleting {name} removes its files, logs and metrics for good; "
                             "pass --yes to delete without being asked")
        if input(f"Delete {name} {what}, for good? [y/N] ").strip().lower() not in ("y", "yes"):
            print(f"{name}: not deleted")
            return FAILED
    delete(name)
    print(f"{name}: deleted")
    return OK


def cmd_download(args):
    client = _client()
    job_id = _job_id(client, args.id)
    kind = "checkpoint" if args.checkpoint else "result"
    artifacts = client.artifacts(job_id, checkpoint=args.checkpoint)
    if not artifacts:
        raise TrainyardError(f"{job_id} has no {kind} files to download")
    destination = args.output or os.path.join(".", job_id)
    total = 0
    for position, artifact in enumerate(artifacts, start=1):
        label = f"[{position}/{len(artifacts)}] {artifact['name']}"
        progress = Progress(label)
        try:
            total += client.download_artifact(job_id, artifact, destination, on_progress=progress.update).size
        finally:
            progress.clear()
        if not isatty(sys.stderr):
            note(f"{label} {human_bytes(artifact.get('size'))}")
    print(f"{len(artifacts)} {kind} file{'s' if len(artifacts) != 1 else ''} ({human_bytes(total)}) in {destination}")
    return OK


def cmd_quota(args):
    info = _client().tenant()
    if args.json:
        print_json(info)
        return OK
    tenant = info.get("tenant") or {}
    print(f"tenant  {tenant.get('slug', '-')} ({tenant.get('name', '')})  role {info.get('role', '-')}")
    quota, usage = info.get("quota") or {}, info.get("usage") or {}
    rows = [(label, quota_value(name, usage.get(name), "-"), quota_value(name, quota.get(name), "no limit"))
            for label, name in QUOTA_ROWS if name in quota or name in usage]
    if rows:
        print_table(("", "USED", "QUOTA"), rows)
    if usage.get("period_start"):
        print(f"budget period  {usage['period_start'][:10]} to {usage['period_end'][:10]} "
              f"({quota.get('budget_mode', 'hard')} limit)")
    budget = info.get("budget") or {}
    if budget.get("reason"):
        print(f"budget  {budget['reason']}")
    storage = info.get("storage") or {}
    if storage.get("reason"):
        print(f"storage  {storage['reason']}")
    queued = info.get("queued") or {}
    if isinstance(queued, dict):
        print(f"queued  {queued.get('jobs', 0)} jobs asking for {queued.get('gpus', 0)} GPUs")
    return OK


def cmd_login(args):
    token = args.token
    if args.sso:
        if token:
            raise UsageError("give either --sso or --token, not both")
        issued = sso.device_login(normalize_url(args.url), notify=note)
        token = issued["token"]
        note(f"signed in as {issued.get('username')}; the token expires at {local_time(issued.get('expires_at'))}")
    if not token:
        if not sys.stdin.isatty():
            raise UsageError("give the API token with --token")
        token = getpass.getpass("API token: ").strip()
    config = Config(url=normalize_url(args.url), token=token, tenant=args.tenant or "")
    where = ""
    if not args.no_verify:
        info = Client(config=config, notify=note).tenant()
        tenant = info.get("tenant") or {}
        where = f": tenant {tenant.get('slug')} as {info.get('role')}"
    path = config_path()
    save_config(config, path)
    print(f"logged in to {config.url}{where}; saved to {path}")
    return OK


# --- entry point -----------------------------------------------------------------------------------
def _override(text):
    """One --set KEY=VALUE as (path, value); argparse says what is wrong with it."""
    try:
        return overrides.parse(text)
    except ManifestError as exc:
        raise argparse.ArgumentTypeError(exc.rule) from None


def _page_size(text):
    """The API pages job lists at 1..200; say so here rather than relay its 400."""
    try:
        size = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= size <= 200:
        raise argparse.ArgumentTypeError(f"{size} is outside 1..200")
    return size


def _state(text):
    """An experiment's state in any case, as --status takes a job's: the API's states are upper case."""
    return text.strip().upper()


def deleting(parser):
    """A delete command's arguments: what to delete, and --yes for a script."""
    parser.add_argument("id", metavar="ID")
    parser.add_argument("-y", "--yes", action="store_true", help="do not ask first (needed when not at a terminal)")


def build_parser():
    parser = argparse.ArgumentParser(
        prog="trainyard", description="Submit and follow training jobs on Trainyard.",
        epilog="Configuration: TRAINYARD_URL, TRAINYARD_TOKEN, TRAINYARD_TENANT, or `trainyard login`. "
               "Exit codes: 0 ok, 1 job failed or server said no, 2 usage or local error.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, handler, help_text, under=commands):
        sub = under.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(handler=handler)
        return sub

    train = command("train", cmd_train, "submit a job: a manifest and a code directory or archive")
    train.add_argument("manifest", metavar="MANIFEST")
    train.add_argument("code", metavar="CODE_DIR_OR_ARCHIVE")
    train.add_argument("--follow", "-f", action="store_true", help="stream the logs until the job ends")
    train.add_argument("--json", action="store_true", help="print the job as JSON instead of its id")
    train.add_argument("--set", action="append", type=_override, default=[], metavar="KEY=VALUE",
                       help="set a manifest field (a dotted path: framework.command=..., learners=2; the value is "
                            "read as YAML, so gpus=2 is a number); repeat for several")
    train.add_argument("--name", help="the job's name, instead of the manifest's")

    listing = command("list", cmd_list, "list the tenant's jobs, newest first")
    listing.add_argument("--status", help="only jobs in this status (comma-separated for several)")
    listing.add_argument("--user", help="only jobs of this user")
    listing.add_argument("--limit", type=_page_size, default=50, help="at most 200 (one page of the API)")
    listing.add_argument("--json", action="store_true")

    show = command("show", cmd_show, "show one job")
    show.add_argument("id", metavar="ID")
    show.add_argument("--json", action="store_true")

    logs = command("logs", cmd_logs, "print a job's log")
    logs.add_argument("id", metavar="ID")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    logs.add_argument("--since", type=int, default=0, metavar="SEQ", help="only lines after this sequence number")

    metrics = command("metrics", cmd_metrics, "print a job's metric points")
    metrics.add_argument("id", metavar="ID")
    metrics.add_argument("--name", help="only this metric")
    metrics.add_argument("--json", action="store_true")

    compare = command("compare", cmd_compare, "compare jobs: what differs in their manifests, final metric values")
    compare.add_argument("ids", metavar="ID", nargs="+")
    compare.add_argument("--json", action="store_true", help="the whole comparison, metric series included")

    for name, help_text in (("halt", "checkpoint a job and release its resources"),
                            ("resume", "queue a halted job again; it resumes from its checkpoint"),
                            ("terminate", "stop a job for good")):
        command(name, cmd_action, help_text).add_argument("id", metavar="ID")
    deleting(command("delete", cmd_delete, "delete an ended job with its files, logs and metrics (its usage stays)"))

    download = command("download", cmd_download, "download a job's results (or checkpoints)")
    download.add_argument("id", metavar="ID")
    download.add_argument("--checkpoint", action="store_true", help="download checkpoints instead of results")
    download.add_argument("-o", "--output", metavar="DIR", help="where to put the files (default ./ID/)")

    quota = command("quota", cmd_quota, "show the tenant's quota and usage")
    quota.add_argument("--json", action="store_true")

    experiment = command("experiment", None, "hyperparameter searches: create, list, show, pause, resume, kill, delete")
    experiment_commands = experiment.add_subparsers(dest="experiment_command", required=True, metavar="ACTION")

    def experiment_command(name, handler, help_text):
        return command(name, handler, help_text, under=experiment_commands)

    create = experiment_command("create", cmd_experiment_create, "start an experiment: an experiment manifest "
                                                                 "and the code its trials run")
    create.add_argument("manifest", metavar="MANIFEST")
    create.add_argument("code", metavar="CODE_DIR_OR_ARCHIVE")
    create.add_argument("--json", action="store_true", help="print the experiment as JSON instead of its id")
    create.add_argument("--wait", action="store_true", help="wait until it completes; exit 1 unless it did")
    experiment_list = experiment_command("list", cmd_experiment_list, "list the tenant's experiments")
    experiment_list.add_argument("--state", type=_state, help="only experiments in this state (ACTIVE, PAUSED, "
                                                               "COMPLETED, TERMINATED; any case)")
    experiment_list.add_argument("--json", action="store_true")
    experiment_show = experiment_command("show", cmd_experiment_show, "show an experiment and its trials")
    experiment_show.add_argument("id", metavar="ID")
    experiment_show.add_argument("--json", action="store_true")
    for name, help_text in (("pause", "halt the running trials through their checkpoints; start none"),
                            ("resume", "go on with a paused experiment"),
                            ("kill", "stop an experiment and all its trials for good")):
        experiment_command(name, cmd_experiment_action, help_text).add_argument("id", metavar="ID")
    deleting(experiment_command("delete", cmd_experiment_delete, "delete a finished experiment with all its trials' "
                                "jobs, their files, logs and metrics (their usage stays)"))

    validate = command("validate", cmd_validate, "check a manifest (a job's or an experiment's) offline")
    validate.add_argument("manifest", metavar="MANIFEST")
    schema = command("schema", cmd_schema, "print the job manifest's JSON Schema (for an editor's completion and "
                                           "checks)")
    schema.add_argument("--experiment", action="store_true", help="the experiment manifest's instead")

    login = command("login", cmd_login, "save the URL and API token to use")
    login.add_argument("--url", required=True)
    login.add_argument("--token", help="the API token (asked for when omitted)")
    login.add_argument("--sso", action="store_true",
                       help="sign in with the organisation's identity provider (device code) for a token that expires")
    login.add_argument("--tenant", help="the tenant to act in, when you belong to several")
    login.add_argument("--no-verify", action="store_true", help="save without checking with the server")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = for_terminal(stdout), for_terminal(stderr)
    try:
        return _run(args)
    finally:
        sys.stdout, sys.stderr = stdout, stderr


def _run(args):
    try:
        return args.handler(args)
    except TrainyardError as error:
        print(f"trainyard: {error}", file=sys.stderr)
        return exit_code(error)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `trainyard logs ID | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return FAILED
    except Exception as error:  # a bug: still one line, unless asked for the traceback
        if os.environ.get("TRAINYARD_CLI_DEBUG"):
            raise
        print(f"trainyard: internal error: {type(error).__name__}: {error} "
              "(set TRAINYARD_CLI_DEBUG=1 to see the traceback)", file=sys.stderr)
        return FAILED


if __name__ == "__main__":
    sys.exit(main())
