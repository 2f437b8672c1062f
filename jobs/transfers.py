"""A job's data transfers, platform side: its training data in (DOWNLOADING) and its results out
(STORING), plus the life of its data-store credentials (sealed at submission, deleted at the end).

jobs.lifecycle and jobs.artifacts call these at the matching points of a job's life; jobs.datastores
does the actual transfers. Which data stores a job has comes from its runtime fields (jobs.runtime),
never from its stored manifest. Progress goes into the job's log as `system` lines (learner 0), so the job page, the
CLI's `logs` and the websocket show it like any other output.
"""
import logging

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from jobs import datastores, disk, egress, live, outbox, runtime, storage
from jobs.models import FINAL, Job, LogLine, Status
from jobs.serializers import log_line_json
from jobs.states import transition
from learner_agent import diskwatch, trees
from tenants import throttling
from trainyard.units import format_bytes

log = logging.getLogger(__name__)
SYSTEM = "lifecycle-manager"
DOWNLOADS_PER_TENANT = 1


def sealing_keys():
    """What the platform seals its secrets with (data-store credentials, webhook secrets): the secret
    key first, then the older ones still accepted, so a key rotated with its predecessor in
    TRAINYARD_SECRET_KEY_FALLBACKS opens what the old one sealed."""
    return [settings.SECRET_KEY, *settings.SECRET_KEY_FALLBACKS]


def seal_submitted_credentials(folder, manifest):
    """At submission: keep the manifest's credentials encrypted beside the job (never in the database)."""
    seal_credentials(folder, datastores.credentials(manifest.raw))


def seal_credentials(folder, secrets):
    """Keep secrets already taken out of a manifest ({store id: {field: value}}) encrypted in `folder`."""
    datastores.seal_credentials(folder, secrets, keys=sealing_keys())


def sealed_credentials(folder):
    """The secrets sealed in `folder` ({} when there are none)."""
    return datastores.unseal_credentials(folder, keys=sealing_keys())


def forget_credentials(job_id, status):
    """At the end: a job in a final state never needs its credentials again."""
    if status in FINAL:
        job = Job.objects.select_related("tenant").filter(pk=job_id).first()
        if job is not None:
            datastores.delete_credentials(storage.job_dir(job.tenant.slug, job.id))


def on_job_event(sender, instance, created, **kwargs):
    """post_save of JobEvent (connected in JobsConfig.ready): every final transition writes one."""
    if created and instance.to_status in FINAL:
        job_id, status = instance.job_id, instance.to_status
        transaction.on_commit(lambda: forget_credentials(job_id, status))


# --- DOWNLOADING ---------------------------------------------------------------------------------
def fetch_training_data(job):
    """Download the job's training data into its data/ folder before any learner starts.

    Returns True when the learners may start (no data stores, data already complete, or just
    fetched), False when they must not (the job failed here, or another worker is fetching). Raises
    outbox.NotYet while another download of its tenant runs (DOWNLOADS_PER_TENANT).
    """
    run = runtime.of(job)
    stores = run.stores_with("training_data")
    folder = storage.job_dir(job.tenant.slug, job.id)
    data_dir = folder / "data"
    if not stores or (data_dir / datastores.FETCHED_MARK).exists():
        return True
    with throttling.slot(_downloading(), job.tenant_id) as free:
        if not free:
            raise outbox.NotYet(f"another download of tenant {job.tenant.slug!r} is under way; this one waits its turn")
        return _fetch(job, run, stores, folder, data_dir)


def _downloading():
    # One download of a tenant at a time: a download holds a lifecycle worker, which every tenant
    # shares, for up to DATA_DOWNLOAD_SECONDS. Kept while it runs; a dead worker's is free in 2 minutes.
    return throttling.AtOnce("data-downloads", limit=DOWNLOADS_PER_TENANT, hold_s=120, renewed=True)


def _fetch(job, run, stores, folder, data_dir):
    with datastores.exclusive(folder / ".fetch.lock") as mine:
        if not mine:
            return False  # a re-driven deploy while the first one downloads; that one goes on
        if (data_dir / datastores.FETCHED_MARK).exists():
            return True  # another worker finished it between the look above and the lock
        labels = ", ".join(repr(s["id"]) for s in stores)
        if job.status == Status.PENDING:
            transition(job.id, Status.DOWNLOADING, actor=SYSTEM, attempt=job.attempt,
                       reason=f"downloading training data from data store {labels}")
        _empty(data_dir)  # what a worker killed mid-download left is outside this download's allowance
        try:
            secrets = sealed_credentials(folder)
            cap = run.disk["data"]
            allowance = datastores.Allowance(cap, settings.DATA_DOWNLOAD_SECONDS,
                                             cap=f"data cap (disk.data) of {format_bytes(cap)}")
            for spec in stores:
                source = datastores.location(spec, "training_data", secrets, **_store_context(job))
                datastores.fetch(source, data_dir, report=lambda line: system_log(job.id, line), allowance=allowance)
        except datastores.transfer_failures() as exc:
            _empty(data_dir)
            failure = datastores.failure_text(exc)
            system_log(job.id, f"[trainyard] {failure}")
            transition(job.id, Status.FAILED, actor=SYSTEM, attempt=job.attempt,
                       reason=f"downloading training data failed: {failure}")
            return False
        (data_dir / datastores.FETCHED_MARK).touch()
    return True


def _empty(data_dir):
    """Leave DATA_DIR empty: moved aside whole and made again, so that one `rm` removes however many
    files a download left."""
    if data_dir.is_dir() and any(data_dir.iterdir()):
        stale = data_dir.with_name(".data-stale")
        trees.remove(stale)  # an earlier one that could not be removed
        data_dir.rename(stale)
        data_dir.mkdir()
        trees.remove(stale)


# --- STORING -------------------------------------------------------------------------------------
def push_results(job, run):
    """Upload RESULT_DIR, the checkpoints and the log to every store with training_results, and mirror
    them into the platform's storage when that is S3. Returns None, or what failed (naming the store;
    also written to the job's log). The caller decides what that means for the job's status.

    All of it takes at most RESULT_UPLOAD_SECONDS: a result store's server that reads slowly or
    trickles its answers holds a lifecycle worker, which every tenant shares, no longer."""
    folder = storage.job_dir(job.tenant.slug, job.id)
    folders = {name: folder / name for name in ("results", "checkpoints", "logs")}
    deadline = datastores.Deadline(settings.RESULT_UPLOAD_SECONDS, doing="upload",
                                   setting="TRAINYARD_RESULT_UPLOAD_SECONDS")
    try:
        targets = _result_targets(job, run, folder)
        if targets and (over := _over_caps(run, folders)) is not None:
            system_log(job.id, f"[trainyard] {over}")
            return over
        for target in targets:
            datastores.push(folders, target, report=lambda line: system_log(job.id, line), deadline=deadline)
    except datastores.transfer_failures() as exc:
        failure = datastores.failure_text(exc)
        system_log(job.id, f"[trainyard] {failure}")
        return failure
    return None


def _over_caps(run, folders):
    """Why the job's output is not pushed, or None. A copy writes each name of a file whole, holes as
    zeros, and a learner makes a file of any length (one truncate) or the same file under many names
    in an instant, between two measurements of its agent's watch: what results/ and checkpoints/
    hold must fit their caps as copied (learner_agent.diskwatch, COPIED) before it is written to
    stores on disks every tenant shares."""
    for name in diskwatch.COPIED:
        cap = run.disk.get(name)
        if not cap:
            continue
        try:
            used = diskwatch.usage([str(folders[name])], copied=True)
        except (diskwatch.TooManyEntries, diskwatch.Unmeasurable):
            return (f"the {name} folder cannot be measured (too many files, or folders nested too deep); "
                    "nothing was pushed to the result stores")
        if used > cap:
            return (f"the {name} folder holds {format_bytes(used)} to copy, over its {disk.describe(name, cap)}; "
                    "nothing was pushed to the result stores")
    return None


def _result_targets(job, run, folder):
    targets = []
    specs = run.stores_with("training_results")
    if specs:
        secrets = sealed_credentials(folder)
        for spec in specs:
            target = datastores.location(spec, "training_results", secrets, **_store_context(job))
            # FfDL's layout: each job's results under its own id in the results container.
            targets.append(datastores.Location(target.store, _join(target.prefix, job.id), target.label))
    mirror = storage.mirror_url()
    if mirror:
        platform = datastores.platform_store(mirror)
        targets.append(datastores.Location(platform.store, _join(platform.prefix, job.tenant.slug, job.id),
                                           platform.label))
    return targets


def _store_context(job):
    """What decides where a job's data stores may lead: its tenant (local folders) and the
    operator's egress policy (S3 endpoints)."""
    return {"data_root": settings.DATA_DIR, "tenant": job.tenant.slug, "egress": egress_policy()}


def egress_policy():
    return egress.EgressPolicy(allow_private=settings.DATASTORE_ALLOW_PRIVATE,
                               allowed=tuple(settings.DATASTORE_ALLOWED_HOSTS))


def _join(*parts):
    return "/".join(p.strip("/") for p in parts if p)


# --- progress lines ------------------------------------------------------------------------------
def system_log(job_id, line):
    """Append one platform line to the job's log (next job-wide seq, under the job's row lock)."""
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id).first()
        if job is None:
            return
        seq = job.log_seq + 1
        Job.objects.filter(pk=job_id).update(log_seq=seq)
        row = LogLine.objects.create(job=job, seq=seq, attempt=job.attempt, learner=0, stream="system",
                                     time=timezone.now(), line=line)
        live.publish_records_on_commit(job_id, [log_line_json(row)], [])
    log.info("%s: %s", job_id, line)
