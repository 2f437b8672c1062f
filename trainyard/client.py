"""`trainyard.Client`: Trainyard's REST API (SPEC §4) as Python calls (an example: the package's docstring).

Jobs, log lines, metric points and artifacts are the API's own JSON objects (dicts), so nothing here
hides a field the server adds. Failures are `trainyard.errors` exceptions with one-line messages.
The standard library, `requests` with `requests-toolbelt` (uploads) and `tenacity` (retries), and
`websockets` for `wait` when it is there: it starts fast and never imports Django.
"""
import contextlib
import hashlib
import io
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import quote, urljoin, urlsplit

import requests
import tenacity
from requests_toolbelt.multipart.encoder import MultipartEncoder, MultipartEncoderMonitor

from trainyard import overrides as manifest_overrides
from trainyard.config import load_config
from trainyard.errors import (ApiError, ConnectionFailed, NotFound, TrainyardError, Unauthorized, UsageError,
                              WaitTimeout, api_error_class)
from trainyard.manifest import ManifestError
from trainyard.packing import Upload, code_upload

log = logging.getLogger("trainyard")

FINAL_STATUSES = ("COMPLETED", "FAILED", "TERMINATED")
RESTING_STATUSES = ("HALTED",)  # not final (resume is possible), but nothing more happens on its own
LOG_PAGE = 1000
POLL_SECONDS = 0.5
# A waiting client reads the job again this often even while its websocket is quiet: a change
# published while the server's fan-out was down is never heard.
RECHECK_SECONDS = 30.0
FIRST_MESSAGE_SECONDS = 5.0  # a job socket's first message (the job) comes at once; past this, read the job
FOLLOW_PATIENCE_SECONDS = 60.0
TIMEOUT = (10, 60)          # connect, read
UPLOAD_TIMEOUT = (10, 600)  # the server inspects the whole archive before it answers


@dataclass(frozen=True)
class Downloaded:
    name: str   # the artifact's name, e.g. results/model.pt
    path: Path  # where it was written
    size: int


class Client:
    """One platform, one token, one tenant. Arguments left out come from TRAINYARD_URL,
    TRAINYARD_TOKEN, TRAINYARD_TENANT, then the configuration `trainyard login` saved.

    `notify(message)` hears what a long call wants to say on the way (a server restart being ridden
    out while following a log); by default it goes to the `trainyard` logger.
    """

    def __init__(self, url=None, token=None, tenant=None, *, session=None, notify=None, config=None):
        self.config = config or load_config(url=url, token=token, tenant=tenant)
        self.notify = notify or log.warning
        self.session = session or requests.Session()
        self.session.headers["Authorization"] = f"Token {self.config.token}"
        if self.config.tenant:
            self.session.headers["X-Trainyard-Tenant"] = self.config.tenant

    @property
    def url(self):
        return self.config.url

    # --- jobs ----------------------------------------------------------------------------------------
    def submit(self, manifest, code, *, overrides=None, name=None, on_progress=None):
        """Submit a job; the new job (QUEUED). `manifest` is a path to a YAML file, the YAML text
        itself (str with newlines, or bytes), or a dict; `code` is a code directory (packed here) or
        a .zip/.tar.gz archive. `overrides` sets manifest fields first, by dotted path, like the CLI's
        --set: a dict ({"framework.command": "python train.py --lr 0.01", "learners": 2}) or a list of
        "KEY=VALUE" texts; `name` sets the job's name. `on_progress(sent, total)` follows the upload."""
        manifest_bytes = _manifest_bytes(manifest)
        if overrides or name is not None:
            manifest_bytes = _overridden(manifest_bytes, overrides, name)
        return self._post_code("/api/v1/jobs/", manifest_bytes, code, on_progress)

    def submit_upload(self, manifest_bytes, upload, *, on_progress=None):
        """Submit already-read manifest bytes and an open `packing.Upload`, streamed, not loaded whole."""
        return self._post_upload("/api/v1/jobs/", manifest_bytes, upload, on_progress=on_progress)

    def _post_code(self, path, manifest_bytes, code, on_progress):
        """POST the manifest with `code` packed (a folder) or opened (an archive), closed afterwards."""
        upload = code_upload(code, warn=self.notify)
        try:
            return self._post_upload(path, manifest_bytes, upload, on_progress=on_progress)
        finally:
            upload.fileobj.close()

    def _post_upload(self, path, manifest_bytes, upload, *, on_progress=None):
        manifest = Upload(io.BytesIO(manifest_bytes), "manifest.yml", "application/x-yaml", len(manifest_bytes))
        body = MultipartBody([("manifest", manifest), ("code", upload)], on_read=on_progress)
        return self.request_json("POST", path, data=body, timeout=UPLOAD_TIMEOUT,
                                 headers={"Content-Type": body.content_type})

    def job(self, job_id):
        """The job as the REST detail: status, status_reason, attempt, exit_code, latest_metrics..."""
        return self.get(_job_path(job_id))

    def resolve_job_id(self, text):
        """The id of the one job of the tenant whose id starts with `text` (with or without its
        `training-`), among the newest jobs that mention it: `text` itself when it is a whole id or
        starts none (the server's 404 then says so). UsageError when it starts several."""
        text = text.strip()
        if WHOLE_JOB_ID.fullmatch(text):
            return text
        wanted = text if text.startswith(JOB_ID_PREFIX) else JOB_ID_PREFIX + text
        page = self.get("/api/v1/jobs/", q=text, limit=MAX_PAGE)
        # Only ids of the platform's own form: an answer's id becomes a folder name (download's ./ID/).
        matches = sorted(job["id"] for job in page.get("results") or []
                         if isinstance(job.get("id"), str) and WHOLE_JOB_ID.fullmatch(job["id"])
                         and job["id"].startswith(wanted))
        if text in matches or not matches:
            return text
        if len(matches) == 1:
            return matches[0]
        shown = ", ".join(matches[:5]) + (", ..." if len(matches) > 5 else "")
        raise UsageError(f"{wanted!r} starts the ids of {len(matches)} jobs ({shown}); give more of the id")

    def jobs(self, *, status=None, user=None, limit=50):
        """The tenant's jobs, newest first: at most `limit` (1..200, one page of the API).
        `status` may name several, comma-separated."""
        return self.get("/api/v1/jobs/", status=status, user=user, limit=limit).get("results") or []

    def wait(self, job_id, *, statuses=FINAL_STATUSES + RESTING_STATUSES, timeout=None, poll=1.0):
        """Wait until the job's status is one of `statuses`; the job. Its status changes arrive over
        the job's websocket as they happen (StatusWatch); where that cannot be opened (no `websockets`
        package, a proxy that refuses upgrades) or drops, the job is polled every `poll` seconds
        instead. WaitTimeout after `timeout` seconds (None: no limit); NotFound when the job is deleted
        meanwhile (its socket says so at once; a poll is answered 404). A server restart meanwhile is
        ridden out, like `logs(follow=True)`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        watch = StatusWatch.open(self, job_id, statuses)  # before the first read: no change can fall in between
        try:
            # The socket's first message is the job as the REST API shows it, read after the socket
            # joined the job's changes: no HTTP read of it is needed (which the web process served
            # just as the job was being scheduled and deployed).
            job = watch.first_job(FIRST_MESSAGE_SECONDS if deadline is None else
                                  max(0.0, min(FIRST_MESSAGE_SECONDS, deadline - time.monotonic()))) if watch else None
            while True:
                if job is None:
                    job = self._patiently(lambda: self.job(job_id))
                if job.get("status") in statuses:
                    return job
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WaitTimeout(f"{job_id} still {job.get('status')} after {timeout:g}s "
                                      f"(waiting for {'/'.join(statuses)})", job=job)
                if watch is not None:
                    seen = watch.until(statuses, RECHECK_SECONDS if left is None else min(RECHECK_SECONDS, left))
                    if isinstance(seen, dict):
                        return seen  # the job as the REST API shows it, sent with the change
                    if not seen:
                        watch = None  # dropped: poll from here on
                if watch is None:
                    time.sleep(poll if left is None else min(poll, left))
                job = None  # read it again
        finally:
            if watch is not None:
                watch.close()

    def logs(self, job_id, *, since=0, follow=False):
        """Yield the job's log lines after `since` ({seq, learner, stream, time, line}), in order.
        With follow, keep going until the job is final or halted; see `log_pages`."""
        for page in self.log_pages(job_id, since=since, follow=follow):
            yield from page

    def log_pages(self, job_id, *, since=0, follow=False):
        """Yield the job's log lines after `since` a page (a list) at a time, as the server gives them.

        With follow, keep polling until the job is final (or halted) and then drain: stop only after
        an empty page that comes after the job was already seen at rest, so lines stored just before
        the last status change are never lost. Server restarts are ridden out for a minute.
        """
        at_rest_before, status = False, None
        path = _job_path(job_id) + "logs/"

        def read_page():  # the page after `since` as it is when called
            return self.get(path, since=since, limit=LOG_PAGE)

        while True:
            page = self._patiently(read_page) if follow else read_page()
            lines = page.get("results") or []
            if lines:
                yield lines
            since = page.get("next_since", lines[-1]["seq"] if lines else since)
            status = page.get("status", status)
            if not follow:
                if len(lines) < LOG_PAGE:
                    return
                continue
            at_rest = bool(page.get("final")) or status in FINAL_STATUSES or status in RESTING_STATUSES
            if at_rest and at_rest_before and not lines:
                return
            at_rest_before = at_rest
            if not lines and not at_rest:
                time.sleep(POLL_SECONDS)

    def metrics(self, job_id, *, name=None):
        """The job's metric points ({name, step, value, time, learner}), optionally of one metric: every
        page of them (the platform answers a page at a time)."""
        points, after = [], 0
        while True:
            page = self.get(_job_path(job_id) + "metrics/", name=name, after=after or None)
            points += page.get("results") or []
            if not page.get("more") or page.get("next_after", after) == after:
                return points
            after = page["next_after"]

    def compare(self, job_ids):
        """Several jobs side by side (2 to 8 ids): {jobs, rows (what differs: {key, label, values}), same,
        metrics ({name, final: [value per job], series: [{job, points: [[step, value]], ...}]})}."""
        return self.get("/api/v1/jobs/compare/", ids=",".join(job_ids))

    def events(self, job_id):
        """The job's status history."""
        return self.get(_job_path(job_id) + "events/").get("results") or []

    def allocations(self, job_id):
        """An elastic job's allocation timeline, oldest attempt first: per attempt {attempt, learners,
        global_batch, local_batch, lr_scale, reason, started_at, ended_at, resize_cost_s, samples_per_s, …}."""
        return self.get(_job_path(job_id) + "allocations/").get("results") or []

    def halt(self, job_id):
        """Checkpoint the job and release its resources; the job (HALTING). Conflict if it cannot."""
        return self._action(job_id, "halt")

    def resume(self, job_id):
        """Queue a halted job again; it resumes from its checkpoint."""
        return self._action(job_id, "resume")

    def terminate(self, job_id):
        """Stop the job for good."""
        return self._action(job_id, "terminate")

    def delete(self, job_id):
        """Delete an ended or halted job: it leaves every list, and its code, results, checkpoints, logs and
        metrics are removed and stop counting against the tenant's storage; its usage stays. Conflict if it
        runs, or is an experiment's trial."""
        return self.request_json("DELETE", _job_path(job_id))

    def _action(self, job_id, action):
        return self.request_json("POST", _job_path(job_id) + f"{action}/")

    # --- experiments -------------------------------------------------------------------------------
    def create_experiment(self, manifest, code, *, on_progress=None):
        """Start a hyperparameter search: an experiment manifest (a job manifest with `hyperparameters`
        and `searcher`, trainyard.experiment) and the code every trial runs; the new experiment."""
        return self._post_code("/api/v1/experiments/", _manifest_bytes(manifest), code, on_progress)

    def create_experiment_upload(self, manifest_bytes, upload, *, on_progress=None):
        return self._post_upload("/api/v1/experiments/", manifest_bytes, upload, on_progress=on_progress)

    def experiments(self, *, state=None):
        """The tenant's experiments, newest first."""
        return self.get("/api/v1/experiments/", state=state)["results"]

    def experiment(self, experiment_id):
        """One experiment with its trials (each trial's job_id is an ordinary job's)."""
        return self.get(_experiment_path(experiment_id))

    def experiment_metrics(self, experiment_id, *, after=0):
        """The searcher's metric as every trial reported it: {"results": [{trial, job_id, step, value,
        time}], "next_after"}."""
        return self.get(_experiment_path(experiment_id) + "metrics/", after=after)

    def pause_experiment(self, experiment_id):
        """No trial starts; running trials are halted through their checkpoints."""
        return self.request_json("POST", _experiment_path(experiment_id) + "pause/")

    def resume_experiment(self, experiment_id):
        return self.request_json("POST", _experiment_path(experiment_id) + "resume/")

    def kill_experiment(self, experiment_id):
        """Stop the experiment and every trial for good."""
        return self.request_json("POST", _experiment_path(experiment_id) + "kill/")

    def delete_experiment(self, experiment_id):
        """Delete a finished experiment with all its trials' jobs (their files, logs and metrics; their
        usage stays). Conflict while it has not finished."""
        return self.request_json("DELETE", _experiment_path(experiment_id))

    def wait_experiment(self, experiment_id, *, timeout=None, poll=2.0):
        """Poll until the experiment is COMPLETED or TERMINATED (TimeoutError past `timeout` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            experiment = self.experiment(experiment_id)
            if experiment["state"] in ("COMPLETED", "TERMINATED"):
                return experiment
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"experiment {experiment_id} is still {experiment['state']} after {timeout}s")
            time.sleep(poll)

    # --- artifacts -----------------------------------------------------------------------------------
    def artifacts(self, job_id, *, checkpoint=False):
        """The job's result files (or checkpoints), newest attempt's file per name, sorted by name."""
        kind = "checkpoint" if checkpoint else "result"
        listed = (artifact for page in self.artifact_pages(job_id) for artifact in page)
        return sorted(_newest_per_name(listed, kind).values(), key=lambda artifact: artifact["name"])

    def artifact_pages(self, job_id):
        """Yield the job's recorded files ({name, kind, size, sha256, attempt, complete, url}) a page (a
        list) at a time, in name order, following the API's `next` links to the last page."""
        page = self.get(_job_path(job_id) + "artifacts/")
        while True:
            yield page.get("results") or []
            if not page.get("next"):
                return
            page = self.get(page["next"])

    def download(self, job_id, dest, *, checkpoint=False):
        """Download the job's results (or checkpoints) under `dest` (dest/results/...); the files.
        Each is checked against its sha256 and appears only once complete."""
        artifacts = self.artifacts(job_id, checkpoint=checkpoint)
        if not artifacts:
            raise TrainyardError(f"{job_id} has no {'checkpoint' if checkpoint else 'result'} files to download")
        return [self.download_artifact(job_id, artifact, dest) for artifact in artifacts]

    def download_artifact(self, job_id, artifact, dest, *, on_progress=None):
        """Stream one artifact (as listed by `artifacts`) to dest/<name> via a temporary file."""
        target = safe_target(dest, artifact["name"])
        url = artifact.get("url") or f"{_job_path(job_id)}artifacts/{quote(artifact['name'])}"
        os.makedirs(os.path.dirname(target), exist_ok=True)
        digest, written = hashlib.sha256(), 0
        expected = artifact.get("size") if type(artifact.get("size")) is int else 0
        fd, temporary = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".download-")
        try:
            with os.fdopen(fd, "wb") as out, self.request("GET", url, stream=True) as response:
                for chunk in response.iter_content(chunk_size=1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    if expected and written > expected:  # what was listed is all that is taken
                        raise TrainyardError(f"{artifact['name']}: the server sends more than the "
                                             f"{expected} bytes it listed; not kept")
                    if on_progress:
                        on_progress(written, max(expected, written))
            if artifact.get("sha256") and digest.hexdigest() != artifact["sha256"]:
                raise TrainyardError(f"{artifact['name']}: downloaded file does not match its sha256; try again")
            os.replace(temporary, target)
        except BaseException:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise
        return Downloaded(artifact["name"], Path(target), written)

    # --- the tenant ----------------------------------------------------------------------------------
    def tenant(self):
        """The tenant acted in, the caller's role, its quota, usage and budget."""
        return self.get("/api/v1/tenants/current/")

    # --- HTTP ----------------------------------------------------------------------------------------
    def get(self, path, **params):
        """GET an API path; the decoded JSON. Parameters that are None are left out."""
        return self.request_json("GET", path, params={k: v for k, v in params.items() if v is not None})

    def _patiently(self, read):
        """`read()`, riding out a server restart: a transient error (no connection, a 5xx) is retried
        with backoff for up to FOLLOW_PATIENCE_SECONDS, said once through `notify`, and so is the
        server's return; a bad answer is never retried."""
        def say_retrying(state):
            if state.attempt_number == 1:
                self.notify(f"{state.outcome.exception()}; retrying for up to {FOLLOW_PATIENCE_SECONDS:.0f}s")

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda error: isinstance(error, TrainyardError) and error.transient),
            wait=tenacity.wait_exponential(multiplier=POLL_SECONDS, max=5.0),
            stop=tenacity.stop_after_delay(FOLLOW_PATIENCE_SECONDS), before_sleep=say_retrying, reraise=True)
        for attempt in retrying:
            with attempt:
                result = read()
        if retrying.statistics["attempt_number"] > 1:
            self.notify("reconnected")
        return result

    def request_json(self, method, path, **kwargs):
        with self.request(method, path, stream=True, **kwargs) as response:
            body = _bounded_body(response)
        try:
            return json.loads(body)
        except ValueError:
            raise ApiError(f"unexpected answer from {response.url}: HTTP {response.status_code}, not JSON",
                           status=response.status_code) from None

    def request(self, method, url, *, timeout=TIMEOUT, **kwargs):
        """The response, or the error it amounts to (ApiError subclasses, ConnectionFailed)."""
        url = self._absolute(url)
        if _origin(url) != _origin(self.config.url):  # e.g. a pre-signed S3 link: never send our token
            kwargs["headers"] = {**kwargs.get("headers", {}), "Authorization": None, "X-Trainyard-Tenant": None}
        try:
            response = self.session.request(method, url, timeout=timeout, **kwargs)
        except requests.ConnectTimeout:
            raise ConnectionFailed(f"cannot reach Trainyard at {self.config.url}: connection timed out") from None
        except requests.Timeout:
            raise ConnectionFailed(f"Trainyard at {self.config.url} did not answer in time") from None
        except requests.ConnectionError as exc:
            raise ConnectionFailed(f"cannot reach Trainyard at {self.config.url}: {_network_reason(exc)}") from None
        except requests.RequestException as exc:
            raise TrainyardError(f"request to {url} failed: {exc}") from None
        if response.status_code >= 400:
            raise api_error(response)
        return response

    def _absolute(self, url):
        """Paths we build are under the configured URL; URLs the server sends are resolved like links."""
        if url.startswith(("http://", "https://")):
            return url
        if url.startswith("/api/"):
            return self.config.url + url
        return urljoin(self.config.url + "/", url)


JOB_ID_PREFIX = "training-"
WHOLE_JOB_ID = re.compile(r"training-[a-z0-9]{10}")  # jobs.models.new_job_id's form
MAX_PAGE = 200  # the most the jobs list answers at once
# The most of one JSON answer read: far past any the platform gives (a page of 200 jobs), short of
# what an endless one would make of this process's memory.
MAX_ANSWER_BYTES = 64 * 2**20
MAX_ERROR_BYTES = 2**20  # of an error answer: its detail is a line or two


def _bounded_body(response, limit=None):
    limit = MAX_ANSWER_BYTES if limit is None else limit
    body = bytearray()
    for chunk in response.iter_content(chunk_size=1 << 16):
        body += chunk
        if len(body) > limit:
            raise ApiError(f"the answer from {response.url} is larger than {limit // 2**20} MiB; not read",
                           status=response.status_code)
    return bytes(body)


def _experiment_path(experiment_id):
    return f"/api/v1/experiments/{quote(str(experiment_id).strip(), safe='')}/"


def _job_path(job_id):
    return f"/api/v1/jobs/{quote(str(job_id).strip(), safe='')}/"


def _manifest_bytes(manifest):
    if isinstance(manifest, bytes):
        return manifest
    if isinstance(manifest, dict):
        return json.dumps(manifest).encode()  # JSON is YAML
    if isinstance(manifest, str) and "\n" in manifest:
        return manifest.encode()
    return read_manifest_file(manifest)


def read_manifest_file(path):
    """A manifest file's bytes; UsageError naming the file when it cannot be read."""
    try:
        with open(path, "rb") as manifest_file:
            return manifest_file.read()
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror or exc}") from None


def _overridden(manifest_bytes, overrides, name):
    """The manifest with the fields set; the server validates the result as any manifest (a path that
    names no field is its 400, naming it)."""
    try:
        return manifest_overrides.overridden(manifest_bytes, manifest_overrides.pairs(overrides, name=name))
    except ManifestError as exc:
        raise UsageError(f"manifest: {exc}") from None


def _newest_per_name(artifacts, kind):
    """After retries a name can repeat across attempts; the newest attempt's file is the one wanted."""
    latest = {}
    for artifact in artifacts:
        if artifact.get("kind") != kind:
            continue
        known = latest.get(artifact["name"])
        if known is None or (artifact.get("attempt") or 0) >= (known.get("attempt") or 0):
            latest[artifact["name"]] = artifact
    return latest


def safe_target(destination, name, *, path=os.path):
    """destination/<name>, refusing a name that would land outside destination. A learner names its
    files: on Windows (`path` is ntpath) a backslash or a colon in one of them is a separator, a drive
    or a stream, so `results/..\\..\\x` would climb out."""
    parts = PurePosixPath(name).parts
    if (not parts or PurePosixPath(name).is_absolute() or any(part in ("..", "") for part in parts)
            or (path.sep == "\\" and any("\\" in part or ":" in part for part in parts))):
        raise TrainyardError(f"the server sent an unsafe artifact name {name!r}; not downloading it")
    return path.join(destination, *parts)


def _origin(url):
    parts = urlsplit(url)
    return parts.scheme, parts.netloc


def _network_reason(exc):
    """'Connection refused' instead of urllib3's nested 'HTTPConnectionPool(...): Max retries...'."""
    text = str(exc)
    match = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    if match:
        return match.group(1).strip()
    for known in ("Name or service not known", "Connection refused", "Connection reset",
                  "Remote end closed connection"):
        if known.lower() in text.lower():
            return known
    return type(exc).__name__


def api_error(response):
    """The exception for an error response, its message carrying the server's detail and field."""
    try:
        body = json.loads(_bounded_body(response, MAX_ERROR_BYTES))
    except (ValueError, ApiError):
        body = None
    detail = field = None
    if isinstance(body, dict):
        detail, field = body.get("detail"), body.get("field")
        if detail is None and body:  # a plain validation error map: {"field": ["message"]}
            key, value = next(iter(body.items()))
            detail, field = " ".join(map(str, value)) if isinstance(value, list) else str(value), key
    status = response.status_code
    detail = str(detail or response.reason or "no details")
    message = f"{field}: {detail}" if field and not detail.startswith(f"{field}:") else detail
    error_class = api_error_class(status)
    if error_class is Unauthorized and status == 401:
        scheme, netloc = _origin(response.url)
        message = (f"not authorised by {scheme}://{netloc}: {message} "
                   "(check TRAINYARD_TOKEN or run `trainyard login`)")
    elif status == 413:
        message = f"too large for the server: {message}"
    elif status >= 500 or status == 429:
        message = f"server error (HTTP {status}): {message}"
    return error_class(message, status=status, detail=detail, field=field)


class StatusWatch:
    """A job's status changes as they happen: its websocket with `?only=status` (the job first, then
    each change; no logs or metrics). `open` gives None where no socket can be had."""

    def __init__(self, socket, closing):
        self.socket, self.closing = socket, closing
        self.unread = None  # a message first_job took that was not the job: until() reads it first

    @classmethod
    def open(cls, client, job_id, statuses=None):
        """`statuses`: those the caller waits for; only a change to one of them carries the job."""
        try:
            from websockets.sync.client import connect
        except ImportError:
            return None
        scheme, netloc, path, _, _ = urlsplit(client.url)
        query = {"only": "status", "token": client.config.token}
        if statuses:
            query["until"] = ",".join(statuses)
        if client.config.tenant:
            query["tenant"] = client.config.tenant
        url = (f"{'wss' if scheme == 'https' else 'ws'}://{netloc}{path.rstrip('/')}/ws/jobs/{quote(job_id, safe='')}/?"
               + "&".join(f"{k}={quote(str(v), safe='')}" for k, v in query.items()))
        closing = contextlib.ExitStack()
        try:
            return cls(closing.enter_context(connect(url, open_timeout=5, close_timeout=1, max_size=2**24)), closing)
        except Exception as error:  # refused, unreachable, not upgraded: polling still works
            closing.close()
            log.debug("no websocket for %s (%s); polling instead", job_id, error)
            return None

    def first_job(self, seconds):
        """The job as the server sends it on opening (its REST detail), or None: the socket closed or
        stayed silent, or its first message was something else (kept for `until`)."""
        try:
            message = json.loads(self.socket.recv(timeout=seconds))
        except Exception:  # silent, closed or not JSON: the caller reads the job, and until() finds out
            return None
        if not isinstance(message, dict):
            return None  # nothing of ours; until() reads on
        job = message.get("job") if message.get("type") == "job" else None
        if isinstance(job, dict) and "status" in job:
            return job
        self.unread = message
        return None

    def until(self, statuses, seconds):
        """Read changes for up to `seconds`, returning early at one to a status in `statuses`: the job
        the change came with (its REST detail, read after the change) if it is in one of `statuses`,
        else True (read it again); True after `seconds`; False if the socket closed (access ended, the
        server went away). NotFound if the job was deleted."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                message, self.unread = self.unread or json.loads(self.socket.recv(timeout=left)), None
            except TimeoutError:
                return True
            except Exception:  # closed, or not JSON
                self.close()
                return False
            if isinstance(message, dict) and message.get("type") == "deleted":
                self.close()
                text = f"{message.get('job') or 'the job'} was deleted"
                raise NotFound(text, status=404, detail=text)
            if _status_in(message) in statuses:
                job = message.get("detail") if message.get("type") == "status" else None
                # A server without it (older), or a job that moved on since: read it again.
                return job if isinstance(job, dict) and job.get("status") in statuses else True
        return True

    def close(self):
        with contextlib.suppress(Exception):  # already gone: nothing to tidy
            self.closing.close()


def _status_in(message):
    """The status a job stream message carries: the job's own first, then each change's (None for
    anything else a server may send)."""
    if not isinstance(message, dict):
        return None
    if message.get("type") == "job":
        job = message.get("job")
        return job.get("status") if isinstance(job, dict) else None
    return message.get("status") if message.get("type") == "status" else None


class MultipartBody(MultipartEncoderMonitor):
    """A multipart/form-data body streamed from the uploads' files by requests-toolbelt's encoder
    (nothing is loaded whole into memory), calling `on_read(sent, total)` as requests reads it."""

    def __init__(self, files, *, on_read=None):
        self._on_read, self._reported = on_read, 0
        encoder = MultipartEncoder(fields=[(field, (upload.filename, upload.fileobj, upload.content_type))
                                           for field, upload in files])
        super().__init__(encoder, self._report if on_read else None)

    def _report(self, body):
        if body.bytes_read != self._reported:  # the encoder reports its last, empty read too
            self._reported = body.bytes_read
            self._on_read(body.bytes_read, body.len)

    def __len__(self):
        return self.len
