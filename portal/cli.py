"""`trainyard`: the command-line client of Trainyard's REST API (SPEC §5).

It talks to the platform only over HTTP and never imports Django, so it starts fast on a laptop. The
one piece of the server it shares is `jobs.manifest` (Django-free), so `trainyard validate` and the
check before every upload give the same verdict as a submission.

Every failure is one line on stderr, never a traceback, with an exit code scripts can rely on:
0 ok, 1 the job failed or the server said no (or could not be reached), 2 a usage or local problem
(bad manifest, bad code directory, missing configuration).
"""
import argparse
import getpass
import hashlib
import io
import json
import os
import re
import sys
import tarfile
import tempfile
import time
import uuid
import zipfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePosixPath
from urllib.parse import quote, urljoin, urlsplit

import requests

from jobs.manifest import ManifestError, parse_manifest

OK, FAILED, USAGE = 0, 1, 2
FINAL_STATUSES = ("COMPLETED", "FAILED", "TERMINATED")
RESTING_STATUSES = ("HALTED",)  # not final (resume is possible), but nothing more happens on its own
EXCLUDED_DIRS = frozenset({".git", "__pycache__", ".venv"})
EXCLUDED_SUFFIXES = (".pyc",)
LOG_PAGE = 1000
POLL_SECONDS = 0.5
FOLLOW_PATIENCE_SECONDS = 60.0
TIMEOUT = (10, 60)          # connect, read
UPLOAD_TIMEOUT = (10, 600)  # the server inspects the whole archive before it answers


class CliError(Exception):
    """A failure to report in one line. `transient` ones (network, 5xx) are worth retrying."""

    def __init__(self, message, *, exit_code=FAILED, transient=False):
        super().__init__(message)
        self.exit_code, self.transient = exit_code, transient


# --- configuration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    url: str
    token: str
    tenant: str = ""


def config_path(environ=None):
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "trainyard", "config.json")


def read_saved_config(path):
    try:
        with open(path) as saved:
            data = json.load(saved)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read {path} ({exc}); run `trainyard login` again", exit_code=USAGE) from None
    return data if isinstance(data, dict) else {}


def load_config(environ=None):
    """Environment variables win over what `trainyard login` saved, one setting at a time."""
    environ = os.environ if environ is None else environ
    saved = read_saved_config(config_path(environ))
    url = environ.get("TRAINYARD_URL") or saved.get("url") or ""
    token = environ.get("TRAINYARD_TOKEN") or saved.get("token") or ""
    tenant = environ.get("TRAINYARD_TENANT") or saved.get("tenant") or ""
    hint = "set TRAINYARD_URL and TRAINYARD_TOKEN, or run `trainyard login --url URL --token TOKEN`"
    if not url:
        raise CliError(f"no Trainyard URL configured: {hint}", exit_code=USAGE)
    if not token:
        raise CliError(f"no API token configured: {hint}", exit_code=USAGE)
    return Config(url=normalize_url(url), token=token, tenant=tenant)


def normalize_url(url):
    if not re.match(r"^https?://[^/]+", url):
        raise CliError(f"{url!r} is not a Trainyard URL; write it like http://localhost:8000", exit_code=USAGE)
    return url.rstrip("/")


def save_config(config, path):
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    data = {"url": config.url, "token": config.token, "tenant": config.tenant}
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.chmod(path, 0o600)  # also when the file existed with looser permissions
    with os.fdopen(descriptor, "w") as out:
        json.dump(data, out, indent=2)
        out.write("\n")


# --- talking to the server -----------------------------------------------------------------------
class Client:
    """The only part of the CLI that does HTTP; it turns every failure into a one-line CliError."""

    def __init__(self, config, *, session=None):
        self.config = config
        self.session = session or requests.Session()
        self.session.headers["Authorization"] = f"Token {config.token}"
        if config.tenant:
            self.session.headers["X-Trainyard-Tenant"] = config.tenant

    def absolute(self, url):
        """Paths we build are under the configured URL; URLs the server sends are resolved like links."""
        if url.startswith(("http://", "https://")):
            return url
        if url.startswith("/api/"):
            return self.config.url + url
        return urljoin(self.config.url + "/", url)

    def request(self, method, url, *, timeout=TIMEOUT, **kwargs):
        url = self.absolute(url)
        if _origin(url) != _origin(self.config.url):  # e.g. a pre-signed S3 link: never send our token
            kwargs["headers"] = {**kwargs.get("headers", {}), "Authorization": None, "X-Trainyard-Tenant": None}
        try:
            response = self.session.request(method, url, timeout=timeout, **kwargs)
        except requests.ConnectTimeout:
            raise CliError(f"cannot reach Trainyard at {self.config.url}: connection timed out",
                           transient=True) from None
        except requests.Timeout:
            raise CliError(f"Trainyard at {self.config.url} did not answer in time", transient=True) from None
        except requests.ConnectionError as exc:
            raise CliError(f"cannot reach Trainyard at {self.config.url}: {_network_reason(exc)}",
                           transient=True) from None
        except requests.RequestException as exc:
            raise CliError(f"request to {url} failed: {exc}") from None
        if response.status_code >= 400:
            raise _api_error(response)
        return response

    def json(self, method, path, **kwargs):
        response = self.request(method, path, **kwargs)
        try:
            return response.json()
        except ValueError:
            raise CliError(f"unexpected answer from {response.url}: HTTP {response.status_code}, "
                           f"not JSON") from None

    def get(self, path, **params):
        return self.json("GET", path, params={k: v for k, v in params.items() if v is not None})


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


def _api_error(response):
    try:
        body = response.json()
    except ValueError:
        body = None
    detail = field = None
    if isinstance(body, dict):
        detail, field = body.get("detail"), body.get("field")
        if detail is None and body:  # a plain validation error map: {"field": ["message"]}
            key, value = next(iter(body.items()))
            detail, field = " ".join(map(str, value)) if isinstance(value, list) else str(value), key
    status = response.status_code
    detail = str(detail or response.reason or "no details")
    if field and not detail.startswith(f"{field}:"):
        detail = f"{field}: {detail}"
    if status == 401:
        return CliError(f"not authorised by {_origin_text(response.url)}: {detail} "
                        "(check TRAINYARD_TOKEN or run `trainyard login`)")
    if status == 413:
        return CliError(f"too large for the server: {detail}")
    if status >= 500 or status == 429:
        return CliError(f"server error (HTTP {status}): {detail}", transient=True)
    return CliError(detail)


def _origin_text(url):
    scheme, netloc = _origin(url)
    return f"{scheme}://{netloc}"


class Patience:
    """Lets a long `--follow` ride out a server restart: transient errors are retried with backoff for
    a while (saying so once) before they become fatal. Bad answers are never retried."""

    def __init__(self, seconds=FOLLOW_PATIENCE_SECONDS, *, sleep=time.sleep, clock=time.monotonic):
        self.seconds, self.sleep, self.clock = seconds, sleep, clock
        self.failing_since, self.delay = None, POLL_SECONDS

    def wait(self, error):
        if not error.transient:
            raise error
        now = self.clock()
        if self.failing_since is None:
            self.failing_since = now
            _note(f"{error}; retrying for up to {self.seconds:.0f}s")
        elif now - self.failing_since > self.seconds:
            raise error
        self.sleep(self.delay)
        self.delay = min(self.delay * 2, 5.0)

    def recovered(self):
        if self.failing_since is not None:
            _note("reconnected")
        self.failing_since, self.delay = None, POLL_SECONDS


# --- packing code --------------------------------------------------------------------------------
@dataclass
class Upload:
    fileobj: object
    filename: str
    content_type: str
    size: int


def code_upload(path):
    """The code to send: a directory packed into a temporary .tar.gz, or a .zip/.tar.gz as it is."""
    if os.path.isdir(path):
        packed = tempfile.TemporaryFile()
        pack_directory(path, packed)
        return Upload(packed, "code.tar.gz", "application/gzip", _size(packed))
    if not os.path.exists(path):
        raise CliError(f"{path}: no such file or directory", exit_code=USAGE)
    lowered = path.lower()
    if lowered.endswith(".zip"):
        if not zipfile.is_zipfile(path):
            raise CliError(f"{path}: not a zip archive", exit_code=USAGE)
        opened = open(path, "rb")
        return Upload(opened, "code.zip", "application/zip", _size(opened))
    if lowered.endswith((".tar.gz", ".tgz")):
        opened = open(path, "rb")
        if opened.read(2) != b"\x1f\x8b":
            opened.close()
            raise CliError(f"{path}: not a gzip-compressed tar archive", exit_code=USAGE)
        return Upload(opened, "code.tar.gz", "application/gzip", _size(opened))
    raise CliError(f"{path}: the code must be a directory, a .zip or a .tar.gz archive", exit_code=USAGE)


def _size(fileobj):
    size = fileobj.seek(0, os.SEEK_END)
    fileobj.seek(0)
    return size


def pack_directory(root, out):
    """Write root's tree as a tar.gz into the binary file `out`, skipping caches and VCS folders.

    The platform accepts no links in archives, so symlinks that stay inside the tree are stored as
    copies of what they point to; a symlink that leads outside the tree is refused (it would pack
    whatever it points to, e.g. a home directory), and so is one that loops back to its own parent.
    """
    root_real = os.path.realpath(root)
    with tarfile.open(fileobj=out, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        _pack_tree(tar, root_real, "", root_real, frozenset({root_real}))
    out.seek(0)


def _pack_tree(tar, folder, arc_folder, root_real, ancestors):
    with os.scandir(folder) as scan:
        entries = sorted(scan, key=lambda entry: entry.name)
    for entry in entries:
        arcname = f"{arc_folder}{entry.name}"
        real = entry.path
        if entry.is_symlink():
            real = os.path.realpath(entry.path)
            if os.path.commonpath([root_real, real]) != root_real:
                raise CliError(f"{arcname}: symlink points outside the code directory "
                               f"(to {os.readlink(entry.path)}); copy what it needs into the directory",
                               exit_code=USAGE)
            if not os.path.exists(real):
                _note(f"skipping {arcname}: broken symlink")
                continue
        if os.path.isdir(real):
            if entry.name in EXCLUDED_DIRS:
                continue
            if real in ancestors:
                raise CliError(f"{arcname}: symlink loops back to one of its parent directories", exit_code=USAGE)
            tar.add(real, arcname=arcname, recursive=False, filter=_anonymous)
            _pack_tree(tar, real, arcname + "/", root_real, ancestors | {real})
        elif os.path.isfile(real):
            if not entry.name.endswith(EXCLUDED_SUFFIXES):
                tar.add(real, arcname=arcname, filter=_anonymous)
        else:
            _note(f"skipping {arcname}: not a regular file or directory")


def _anonymous(info):
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


class MultipartBody:
    """A multipart/form-data body read piece by piece from files (nothing is loaded whole into
    memory), calling `on_read(sent, total)` as the HTTP library consumes it."""

    def __init__(self, files, *, on_read=None):
        self.boundary = uuid.uuid4().hex
        self._pieces, self._index, self.sent, self.on_read = [], 0, 0, on_read
        self.length = 0
        for field, upload in files:
            head = (f"--{self.boundary}\r\nContent-Disposition: form-data; name=\"{field}\"; "
                    f"filename=\"{upload.filename}\"\r\nContent-Type: {upload.content_type}\r\n\r\n").encode()
            self._add(io.BytesIO(head), len(head))
            self._add(upload.fileobj, upload.size)
            self._add(io.BytesIO(b"\r\n"), 2)
        tail = f"--{self.boundary}--\r\n".encode()
        self._add(io.BytesIO(tail), len(tail))

    def _add(self, fileobj, size):
        self._pieces.append(fileobj)
        self.length += size

    @property
    def content_type(self):
        return f"multipart/form-data; boundary={self.boundary}"

    def __len__(self):
        return self.length

    def read(self, size=-1):
        chunks, wanted = [], size if size is not None and size >= 0 else None
        while self._index < len(self._pieces) and (wanted is None or wanted > 0):
            chunk = self._pieces[self._index].read(-1 if wanted is None else wanted)
            if not chunk:
                self._index += 1
                continue
            chunks.append(chunk)
            if wanted is not None:
                wanted -= len(chunk)
        data = b"".join(chunks)
        self.sent += len(data)
        if self.on_read and data:
            self.on_read(self.sent, self.length)
        return data


# --- output helpers ------------------------------------------------------------------------------
def _note(message):
    print(f"trainyard: {message}", file=sys.stderr, flush=True)


class Progress:
    """One self-overwriting status line on stderr, drawn only when stderr is a terminal."""

    def __init__(self, label, *, stream=None, enabled=None):
        self.stream = stream or sys.stderr
        self.enabled = _isatty(self.stream) if enabled is None else enabled
        self.label, self.drawn_at = label, 0.0

    def update(self, done, total):
        now = time.monotonic()
        if not self.enabled or (now - self.drawn_at < 0.1 and done < total):
            return
        self.drawn_at = now
        percent = f"{100 * done // total:3d}%" if total else ""
        self.stream.write(f"\r\x1b[K{self.label} {percent} {human_bytes(done)} / {human_bytes(total)}")
        self.stream.flush()

    def message(self, text):
        if self.enabled:
            self.stream.write(f"\r\x1b[K{text}")
            self.stream.flush()

    def clear(self):
        self.message("")


def _isatty(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def human_bytes(size):
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024


def local_time(stamp):
    if not stamp:
        return "-"
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return str(stamp)


def print_table(headers, rows):
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    for row in [headers, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())


def print_json(data):
    print(json.dumps(data, indent=2, sort_keys=False))


def _number(value):
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def render_job(job, base_url):
    """The readable summary `trainyard show` prints."""
    manifest = job.get("manifest") or {}
    framework = manifest.get("framework") if isinstance(manifest.get("framework"), dict) else {}
    status = job.get("status", "?")
    rows = [("status", status + (f" — {job['status_reason']}" if job.get("status_reason") else ""))]
    if job.get("wait_reason") and status == "QUEUED":
        rows.append(("waiting", job["wait_reason"]))
    if job.get("queue_position") is not None:
        rows.append(("queue", f"position {job['queue_position']}"))
    attempt = str(job.get("attempt", "-"))
    if job.get("exit_code") is not None:
        attempt += f", exit code {job['exit_code']}"
    rows += [("attempt", attempt),
             ("framework", " ".join(filter(None, [job.get("framework"), str(framework.get("version") or "")])))]
    if framework.get("command"):
        rows.append(("command", " ".join(str(framework["command"]).split())))
    learners = job.get("learners", 1)
    rows += [("resources", f"{learners} learner{'s' if learners != 1 else ''} × "
                           f"{job.get('gpus', 0)} GPU, {_number(job.get('cpus', 0))} CPU, "
                           f"{human_bytes(job.get('memory_bytes'))}"),
             ("priority", job.get("priority", "-")),
             ("owner", f"{job.get('owner', '-')} in {job.get('tenant', '-')}")]
    rows += [(label, local_time(job.get(f"{label}_at"))) for label in ("created", "admitted", "started", "finished")]
    metrics = job.get("latest_metrics") or {}
    if metrics:
        rows.append(("metrics", ", ".join(f"{name} {_number(point.get('value'))} (step {point.get('step')})"
                                          for name, point in sorted(metrics.items()))))
    if job.get("page_url"):
        rows.append(("page", urljoin(base_url + "/", job["page_url"])))
    lines = [f"{job.get('id')}  {job.get('name', '')}".rstrip()]
    lines += [f"  {label:<10} {value}" for label, value in rows]
    return "\n".join(lines)


def _final_message(job):
    status = job.get("status")
    text = f"{job.get('id')} {status}"
    if job.get("status_reason"):
        text += f": {job['status_reason']}"
    if job.get("exit_code") not in (None, 0) and f"code {job['exit_code']}" not in str(job.get("status_reason")):
        text += f" (exit code {job['exit_code']})"
    if status in RESTING_STATUSES:
        text += f"; `trainyard resume {job.get('id')}` continues it"
    return text


# --- following logs ------------------------------------------------------------------------------
def stream_logs(client, job_id, *, since=0, follow=False, show_learner=False, patience=None, sleep=time.sleep):
    """Print the job's log lines after `since`. With follow, poll until the job is final (or halted)
    and then drain: stop only after an empty page that comes after the job was already seen at rest,
    so lines stored just before the last status change are never lost. Returns the last status."""
    patience = patience or Patience(sleep=sleep)
    at_rest_before, status = False, None
    while True:
        try:
            page = client.get(f"/api/v1/jobs/{job_id}/logs/", since=since, limit=LOG_PAGE)
        except CliError as error:
            if not follow:
                raise
            patience.wait(error)
            continue
        patience.recovered()
        lines = page.get("results") or []
        for line in lines:
            prefix = f"[learner {line.get('learner')}] " if show_learner else ""
            print(f"{prefix}{line.get('line', '')}")
        sys.stdout.flush()
        since = page.get("next_since", lines[-1]["seq"] if lines else since)
        status = page.get("status", status)
        if not follow:
            if len(lines) < LOG_PAGE:
                return status
            continue
        at_rest = bool(page.get("final")) or status in FINAL_STATUSES or status in RESTING_STATUSES
        if at_rest and at_rest_before and not lines:
            return status
        at_rest_before = at_rest
        if not lines and not at_rest:
            sleep(POLL_SECONDS)


# --- commands ------------------------------------------------------------------------------------
def _client():
    return Client(load_config())


def _read_manifest(path):
    try:
        with open(path, "rb") as manifest_file:
            text = manifest_file.read()
    except OSError as exc:
        raise CliError(f"{path}: {exc.strerror or exc}", exit_code=USAGE) from None
    try:
        return text, parse_manifest(text)
    except ManifestError as exc:
        raise CliError(f"{path}: invalid manifest: {exc}", exit_code=USAGE) from None


def cmd_validate(args):
    _, manifest = _read_manifest(args.manifest)
    learners = f"{manifest.learners} learner{'s' if manifest.learners != 1 else ''}"
    print(f"{args.manifest}: ok — {manifest.name}: {manifest.framework} {manifest.framework_version}".rstrip()
          + f", {learners} × {manifest.gpus} GPU, {manifest.cpus:g} CPU, {human_bytes(manifest.memory_bytes)}")
    # What an FfDL manifest (or an FfDL name) was mapped to, so nothing is translated silently.
    for note in manifest.notes:
        print(f"  mapped: {note}")
    return OK


def cmd_train(args):
    manifest_bytes, _ = _read_manifest(args.manifest)
    upload = code_upload(args.code)
    try:
        client = _client()
        job = submit(client, manifest_bytes, upload)
    finally:
        upload.fileobj.close()
    if args.json:
        print_json(job)
    else:
        print(job["id"], flush=True)
    if _isatty(sys.stderr) and not args.follow:
        _note(f"submitted {job['id']} ({job.get('status')}); follow it with `trainyard logs {job['id']} --follow`")
    if not args.follow:
        return OK
    try:
        stream_logs(client, job["id"], follow=True, show_learner=job.get("learners", 1) > 1)
    except KeyboardInterrupt:
        _note(f"\nstopped following; {job['id']} keeps running (`trainyard logs {job['id']} --follow`)")
        return 130
    return _report_final(client.get(f"/api/v1/jobs/{job['id']}/"))


def submit(client, manifest_bytes, upload):
    manifest = Upload(io.BytesIO(manifest_bytes), "manifest.yml", "application/x-yaml", len(manifest_bytes))
    progress = Progress(f"uploading {upload.filename} ({human_bytes(upload.size)})")
    body = MultipartBody([("manifest", manifest), ("code", upload)], on_read=progress.update)
    try:
        response = client.json("POST", "/api/v1/jobs/", data=body, timeout=UPLOAD_TIMEOUT,
                               headers={"Content-Type": body.content_type})
    finally:
        progress.clear()
    return response


def _report_final(job):
    _note(_final_message(job))
    return OK if job.get("status") == "COMPLETED" else FAILED


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
        _note(f"showing {len(jobs)} of {page['count']} jobs; use --limit for more")
    return OK


def cmd_show(args):
    client = _client()
    job = client.get(f"/api/v1/jobs/{_job_id(args.id)}/")
    if args.json:
        print_json(job)
    else:
        print(render_job(job, client.config.url))
    return OK


def cmd_logs(args):
    client = _client()
    job = client.get(f"/api/v1/jobs/{_job_id(args.id)}/")
    stream_logs(client, job["id"], since=args.since, follow=args.follow, show_learner=job.get("learners", 1) > 1)
    return OK


def cmd_metrics(args):
    points = _client().get(f"/api/v1/jobs/{_job_id(args.id)}/metrics/", name=args.name).get("results") or []
    if args.json:
        print_json(points)
        return OK
    if not points:
        _note(f"{args.id} has no metrics yet")
        return OK
    rows = sorted(points, key=lambda p: (str(p.get("name")), p.get("step") if p.get("step") is not None else -1))
    print_table(("NAME", "STEP", "VALUE", "LEARNER", "TIME"),
                [(p.get("name"), "-" if p.get("step") is None else p["step"], _number(p.get("value")),
                  p.get("learner", "-"), local_time(p.get("time"))) for p in rows])
    return OK


def cmd_action(args):
    job = _client().json("POST", f"/api/v1/jobs/{_job_id(args.id)}/{args.command}/")
    print(f"{job.get('id')}: {job.get('status')}")
    return OK


def cmd_download(args):
    client = _client()
    job_id = _job_id(args.id)
    kind = "checkpoint" if args.checkpoint else "result"
    latest = _newest_per_name(client.get(f"/api/v1/jobs/{job_id}/artifacts/").get("results") or [], kind)
    if not latest:
        raise CliError(f"{job_id} has no {kind} files to download")
    destination = args.output or os.path.join(".", job_id)
    total = 0
    for number, artifact in enumerate(sorted(latest.values(), key=lambda a: a["name"]), start=1):
        label = f"[{number}/{len(latest)}] {artifact['name']}"
        total += download_artifact(client, job_id, artifact, destination, Progress(label))
        if not _isatty(sys.stderr):
            _note(f"{label} {human_bytes(artifact.get('size'))}")
    print(f"{len(latest)} {kind} file{'s' if len(latest) != 1 else ''} ({human_bytes(total)}) in {destination}")
    return OK


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


def download_artifact(client, job_id, artifact, destination, progress):
    """Stream one artifact to destination/<name> via a temporary file, checking its sha256."""
    target = _safe_target(destination, artifact["name"])
    url = artifact.get("url") or f"/api/v1/jobs/{job_id}/artifacts/{quote(artifact['name'])}"
    os.makedirs(os.path.dirname(target), exist_ok=True)
    digest, written = hashlib.sha256(), 0
    expected = artifact.get("size") or 0
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".download-")
    try:
        with os.fdopen(fd, "wb") as out, client.request("GET", url, stream=True) as response:
            for chunk in response.iter_content(chunk_size=1 << 20):
                out.write(chunk)
                digest.update(chunk)
                written += len(chunk)
                progress.update(written, max(expected, written))
        progress.clear()
        if artifact.get("sha256") and digest.hexdigest() != artifact["sha256"]:
            raise CliError(f"{artifact['name']}: downloaded file does not match its sha256; try again")
        os.replace(temporary, target)
    except BaseException:
        progress.clear()
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    return written


def _safe_target(destination, name):
    parts = PurePosixPath(name).parts
    if not parts or PurePosixPath(name).is_absolute() or any(part in ("..", "") for part in parts):
        raise CliError(f"the server sent an unsafe artifact name {name!r}; not downloading it")
    return os.path.join(destination, *parts)


def cmd_quota(args):
    info = _client().get("/api/v1/tenants/current/")
    if args.json:
        print_json(info)
        return OK
    tenant = info.get("tenant") or {}
    print(f"tenant  {tenant.get('slug', '-')} ({tenant.get('name', '')})  role {info.get('role', '-')}")
    quota, usage = info.get("quota") or {}, info.get("usage") or {}
    rows = [(label, _quota_value(name, usage.get(name), "-"), _quota_value(name, quota.get(name), "no limit"))
            for label, name in QUOTA_ROWS if name in quota or name in usage]
    if rows:
        print_table(("", "USED", "QUOTA"), rows)
    if usage.get("period_start"):
        print(f"budget period  {usage['period_start'][:10]} to {usage['period_end'][:10]} "
              f"({quota.get('budget_mode', 'hard')} limit)")
    budget = info.get("budget") or {}
    if budget.get("reason"):
        print(f"budget  {budget['reason']}")
    queued = info.get("queued") or {}
    if isinstance(queued, dict):
        print(f"queued  {queued.get('jobs', 0)} jobs asking for {queued.get('gpus', 0)} GPUs")
    return OK


QUOTA_ROWS = (("GPUs in use", "gpus"), ("CPUs in use", "cpus"), ("memory in use", "memory_bytes"),
              ("jobs running", "jobs"), ("GPU-hours this period", "gpu_hours"),
              ("CPU-hours this period", "cpu_hours"))


def _quota_value(name, value, missing):
    if value is None:
        return missing
    if "memory" in name or name.endswith("bytes"):
        return human_bytes(value)
    return _number(value)


def cmd_login(args):
    token = args.token
    if not token:
        if not sys.stdin.isatty():
            raise CliError("give the API token with --token", exit_code=USAGE)
        token = getpass.getpass("API token: ").strip()
    config = Config(url=normalize_url(args.url), token=token, tenant=args.tenant or "")
    where = ""
    if not args.no_verify:
        info = Client(config).get("/api/v1/tenants/current/")
        tenant = info.get("tenant") or {}
        where = f": tenant {tenant.get('slug')} as {info.get('role')}"
    path = config_path()
    save_config(config, path)
    print(f"logged in to {config.url}{where}; saved to {path}")
    return OK


def _job_id(value):
    value = value.strip()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", value):
        raise CliError(f"{value!r} is not a job id (they look like training-ab12cd34)", exit_code=USAGE)
    return value


# --- entry point ---------------------------------------------------------------------------------
def _page_size(text):
    """The API pages job lists at 1..200; say so here rather than relay its 400."""
    try:
        size = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= size <= 200:
        raise argparse.ArgumentTypeError(f"{size} is outside 1..200")
    return size


def build_parser():
    parser = argparse.ArgumentParser(
        prog="trainyard", description="Submit and follow training jobs on Trainyard.",
        epilog="Configuration: TRAINYARD_URL, TRAINYARD_TOKEN, TRAINYARD_TENANT, or `trainyard login`. "
               "Exit codes: 0 ok, 1 job failed or server said no, 2 usage or local error.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, handler, help_text):
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(handler=handler)
        return sub

    train = command("train", cmd_train, "submit a job: a manifest and a code directory or archive")
    train.add_argument("manifest", metavar="MANIFEST")
    train.add_argument("code", metavar="CODE_DIR_OR_ARCHIVE")
    train.add_argument("--follow", "-f", action="store_true", help="stream the logs until the job ends")
    train.add_argument("--json", action="store_true", help="print the job as JSON instead of its id")

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

    for name, help_text in (("halt", "checkpoint a job and release its resources"),
                            ("resume", "queue a halted job again; it resumes from its checkpoint"),
                            ("terminate", "stop a job for good")):
        command(name, cmd_action, help_text).add_argument("id", metavar="ID")

    download = command("download", cmd_download, "download a job's results (or checkpoints)")
    download.add_argument("id", metavar="ID")
    download.add_argument("--checkpoint", action="store_true", help="download checkpoints instead of results")
    download.add_argument("-o", "--output", metavar="DIR", help="where to put the files (default ./ID/)")

    quota = command("quota", cmd_quota, "show the tenant's quota and usage")
    quota.add_argument("--json", action="store_true")

    validate = command("validate", cmd_validate, "check a manifest offline")
    validate.add_argument("manifest", metavar="MANIFEST")

    login = command("login", cmd_login, "save the URL and API token to use")
    login.add_argument("--url", required=True)
    login.add_argument("--token", help="the API token (asked for when omitted)")
    login.add_argument("--tenant", help="the tenant to act in, when you belong to several")
    login.add_argument("--no-verify", action="store_true", help="save without checking with the server")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except CliError as error:
        print(f"trainyard: {error}", file=sys.stderr)
        return error.exit_code
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
