"""The workload every chaos scenario submits, and what must hold after it, checked against the
platform's API, its database and this machine's processes.

The workload (workload/chatter.py) is deterministic, so for each attempt we know exactly which lines
it prints, in which order, and which metric points they carry: the platform's copy must be that
output (or, for an attempt whose learner was killed, a prefix of it), every line once, nothing else.
"""
import json
import time
from pathlib import Path

from jobs.models import Status
from jobs.states import TRANSITIONS
from trainyard.packing import code_upload

WORKLOAD = Path(__file__).parent / "workload"
LINES, EVERY, SECONDS = 3000, 100, 6.0
RECORDS_BESIDE_OUTPUT = 3  # status records of an attempt: preparing, running, exited


def manifest(*, max_retries=0):
    restart = f"restart_policy: {{max_retries: {max_retries}}}\n" if max_retries else ""
    return (f"name: chaos-chatter\ncpus: 0.5\nmemory: 256MiB\n{restart}"
            f'framework: {{name: custom, command: "python3 chatter.py {LINES} {EVERY} {SECONDS}"}}\n')


def submit(chaos, *, max_retries=0):
    """Submit the workload; (job id, when it was submitted on the monotonic clock)."""
    code = code_upload(str(WORKLOAD))
    with code.fileobj:
        response = chaos.api("POST", "/api/v1/jobs/", files={
            "manifest": ("manifest.yml", manifest(max_retries=max_retries)),
            "code": (code.filename, code.fileobj.read())})
    assert response.status_code == 201, response.text
    return response.json()["id"], time.monotonic()


def printed_by(attempt):
    """Every line chatter.py prints in attempt `attempt`, in order; [(line, metric step or None)]."""
    out = []
    for i in range(1, LINES + 1):
        out.append((f"a{attempt} line {i:05d} of {LINES}", None))
        if i % EVERY == 0:
            step = i // EVERY
            out.append(("TRAINYARD_METRIC " + json.dumps({"name": "loss", "value": attempt * 10000 + step,
                                                          "step": step, "attempt": attempt}), step))
    return out


def attempt_of(line):
    """The attempt that printed a workload line; None for any other line."""
    try:
        if line.startswith("TRAINYARD_METRIC "):
            return json.loads(line[len("TRAINYARD_METRIC "):])["attempt"]
        if line.startswith("a") and " line " in line:
            return int(line.split()[0][1:])
    except (ValueError, KeyError):
        pass
    return None


def lines_by_attempt(logs):
    """{attempt: [log line JSON]} in seq order. Attempts run one after the other, so a line that
    names no attempt (the shell's stderr) belongs to the attempt whose output came before it."""
    by_attempt, current = {}, None
    for line in logs:
        current = attempt_of(line["line"]) or current
        by_attempt.setdefault(current, []).append(line)
    return by_attempt


def check_job(chaos, job_id, *, status, attempts, context=""):
    """Everything the issue asks of a scenario's job. `attempts` maps each attempt to "complete"
    (its learner ran to the end) or "killed" (its learner died part-way: a prefix of its output)."""
    job = chaos.wait_for(job_id, {"COMPLETED", "FAILED", "TERMINATED"}, timeout=40)
    assert job["status"] == status, f"{context}: {job_id} ended {job['status']}: {job['status_reason']}"
    assert job["final"] and job["attempt"] == max(attempts)
    stored = check_logs_and_metrics(chaos, job_id, attempts, context)
    check_learners(chaos, job_id, attempts, stored, context)
    check_events(chaos, job_id, context)
    check_no_agent_left(chaos, job_id, context)
    check_usage_released(chaos, context)
    return job


def check_logs_and_metrics(chaos, job_id, attempts, context):
    """Exact log lines and metric points per attempt; returns {attempt: records its learner sent}."""
    logs = chaos.session.all_logs(job_id)
    assert [x["seq"] for x in logs] == list(range(1, len(logs) + 1)), f"{context}: log seqs are not dense 1..n"
    texts = [x["line"] for x in logs]
    assert len(set(texts)) == len(texts), f"{context}: duplicated lines: " + repr(
        sorted({t for t in texts if texts.count(t) > 1})[:5])
    by_attempt = lines_by_attempt(logs)
    assert set(by_attempt) == set(attempts), f"{context}: lines of attempts {sorted(by_attempt, key=str)}"
    points = chaos.api("GET", f"/api/v1/jobs/{job_id}/metrics/").json()["results"]
    assert {p["value"] // 10000 for p in points} <= set(attempts), f"{context}: metric points of unknown attempts"
    records = {}
    for attempt, how in attempts.items():
        got = [x["line"] for x in by_attempt[attempt]]
        records[attempt] = len(got)
        expected = printed_by(attempt)
        if how == "killed":
            if by_attempt[attempt][-1]["stream"] == "stderr" and got[-1] == "Killed":
                got = got[:-1]  # /bin/sh (dash) reports its child's death
            expected = expected[:len(got)]  # whatever it printed before it died, nothing missing
        assert got == [line for line, _ in expected], (
            f"{context}: attempt {attempt}: {len(got)} lines stored, first difference at index "
            f"{next((i for i, (a, (b, _)) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))}")
        steps = [p["step"] for p in points if p["value"] // 10000 == attempt]
        assert steps == [step for _, step in expected if step is not None], (
            f"{context}: attempt {attempt}: metric steps {steps[:5]}… ({len(steps)}) do not match the "
            f"{sum(1 for _, s in expected if s is not None)} metric lines printed")
        records[attempt] += len(steps)
    for sample in resource_samples(chaos, job_id):  # the agent's own records, each stored once
        records[sample["attempt"]] = records.get(sample["attempt"], 0) + 1
    return records


def resource_samples(chaos, job_id):
    samples, after = [], 0
    while True:
        page = chaos.api("GET", f"/api/v1/jobs/{job_id}/resources/", params={"after": after}).json()
        samples += page["results"]
        if not page["more"]:
            return samples
        after = page["next_after"]


def check_learners(chaos, job_id, attempts, records, context):
    """In the database: every learner of every attempt has exited, and acked all it sent."""
    learners = json.loads(chaos.session.manage("shell", "-v", "0", "-c", (
        "import json; from jobs.models import Learner; "
        f"print(json.dumps(list(Learner.objects.filter(job_id={job_id!r}).order_by('attempt', 'index')"
        ".values('attempt', 'index', 'state', 'exit_code', 'acked_seq'))))")))
    assert [(lr["attempt"], lr["index"]) for lr in learners] == [(a, 0) for a in sorted(attempts)], context
    for learner in learners:
        attempt = learner["attempt"]
        assert learner["state"] == "exited", f"{context}: {learner}"
        assert learner["exit_code"] == (0 if attempts[attempt] == "complete" else 137), f"{context}: {learner}"
        # seqs are per attempt and gap-free: status records + one per line, metric point and resource sample
        assert learner["acked_seq"] == records[attempt] + RECORDS_BESIDE_OUTPUT, f"{context}: {learner}"


def check_events(chaos, job_id, context):
    """Each event continues from the one before, along an allowed transition; none is written twice."""
    events = chaos.api("GET", f"/api/v1/jobs/{job_id}/events/").json()["results"]
    assert events[0]["to_status"] == "QUEUED" and not events[0]["from_status"], context
    for before, after in zip(events, events[1:]):
        assert after["from_status"] == before["to_status"], f"{context}: {before} then {after}"
        assert after["to_status"] in TRANSITIONS[Status(before["to_status"])], f"{context}: {before} then {after}"


def check_no_agent_left(chaos, job_id, context, timeout=15):
    """No process of this job (agent, sandbox, learner) outlives it."""
    job_dir = next(chaos.session.data_dir.glob(f"storage/*/{job_id}"))
    deadline = time.monotonic() + timeout
    while (left := processes_under(job_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"{context}: still running for {job_id}: {left}"


def processes_under(job_dir):
    """{pid: cmdline} of processes that mention the job's folder or work inside it."""
    found = {}
    marker = str(job_dir)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = str((proc / "cwd").readlink())
        except OSError:
            continue
        if marker in cmdline or cwd.startswith(marker):
            found[int(proc.name)] = cmdline
    return found


def check_usage_released(chaos, context, timeout=10):
    """Usage is consistent with the jobs: every attempt's usage record is closed (nothing held, so
    GPU-hours stop growing), nothing is queued, and the cluster counts no GPU or CPU as used."""
    deadline = time.monotonic() + timeout
    while True:
        tenant = chaos.api("GET", "/api/v1/tenants/current/").json()
        cluster = chaos.api("GET", "/api/v1/cluster/").json()
        usage = tenant["usage"]
        held = ((usage["gpus"], usage["cpus"], usage["jobs"]), tenant["queued"]["jobs"], cluster["gpus_used"],
                [(n["gpus_used"], n["cpus_used"]) for n in cluster["nodes"]])
        if held == ((0, 0, 0), 0, 0, [(0, 0)] * len(cluster["nodes"])):
            return
        assert time.monotonic() < deadline, f"{context}: resources still held after the job ended: {held}"
        time.sleep(0.2)
