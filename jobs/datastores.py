"""Data stores: where a job's training data comes from and where its results go, and the platform's
own artifact storage behind TRAINYARD_STORAGE_URL. One small interface (`Store`: list, get, put)
with two implementations, `LocalStore` (a directory) and `S3Store` (any S3-compatible server,
through boto3), and the two transfers built on it: `fetch` (DOWNLOADING: a prefix into DATA_DIR)
and `push` (STORING: RESULT_DIR and the checkpoints out).

Credentials a manifest carries (a data store's `connection`) are secrets: `redact_yaml`/`redact`
remove them before the manifest is stored or shown, `seal_credentials` keeps them encrypted
(Fernet, with a key derived from SECRET_KEY; older keys in SECRET_KEY_FALLBACKS still open) in the job's folder, and they are deleted when the job
reaches a final state. Error messages name the store and the problem, never a secret.

Where transfers run: on the local backend, the lifecycle worker downloads into the job's data/
folder before any learner starts (the learners then see it read-only), and uploads at STORING.
A Kubernetes backend would do the same from an init container (download) and the agent's exit
path (upload), handing the sealed credentials over as a Kubernetes Secret.

Imports are Django-free at module level (the manifest parser and the CLI import this module).
"""
import base64
import errno
import fcntl
import hashlib
import io
import json
import os
import secrets
import socket
import stat
import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

import yaml

from jobs import egress
from learner_agent import diskwatch
from trainyard.units import format_bytes

# A connection's fields that are addresses, not secrets; every other field is redacted.
PUBLIC_CONNECTION_FIELDS = ("auth_url", "region", "type")
REDACTED = "<redacted>"
SEALED_FILE = ".credentials.sealed"
FETCHED_MARK = ".trainyard-fetched"  # in DATA_DIR: this job's data is complete (attempts share it)
LOCAL_STORES_DIR = "datastores"  # under TRAINYARD_DATA_DIR: <tenant>/<container> of `type: local` stores
MAX_SERVER_TEXT = 300  # of an S3 server's error message: the endpoint is whoever wrote the manifest
MAX_REASON = 1000  # of a transfer failure, as a job's reason and log line
PROGRESS_EVERY_S = 2.0  # between two progress lines of a transfer in the job's log
# Objects one download lists at most: the listing is held in memory before the first byte is fetched,
# and a server may list without end; past it, the data belongs in fewer, larger objects (archives).
MAX_OBJECTS = 100_000
MAX_KEY_BYTES = 1024  # S3's own limit on a key; longer ones only come from a server that means harm
# Of one answer that is no object's content (a listing page, an upload's answer, any error): botocore
# reads such an answer whole into memory before parsing it, and a server may send one without end.
MAX_ANSWER_BYTES = 16 * 2**20


class DataStoreError(Exception):
    """A transfer failed; the message names the store and the cause (and is safe to show)."""


# --- the store interface and its two implementations ---------------------------------------------
class Deadline:
    """`seconds` in all for a transfer (`doing`: "download", "upload"), set by the operator's
    `setting`: past it the transfer stops with a message naming both, and its stores' connections
    are cut (`_cut_past`)."""

    def __init__(self, seconds, *, doing, setting):
        self.seconds, self.doing, self.setting = seconds, doing, setting
        self.deadline = time.monotonic() + seconds

    def check_time(self, label):
        if self.past_deadline():
            raise DataStoreError(f"{label}: the {self.doing} took longer than {self.seconds}s in all "
                                 f"({self.setting}); stopped")

    def past_deadline(self):
        return time.monotonic() > self.deadline


class Allowance(Deadline):
    """What a download may still take: `most_bytes` (the job's data cap, named `cap` in a refusal)
    and `seconds` in all. Counted as bytes are written, not from what a listing says (a data store's
    server says what it likes): one reading past either raises DataStoreError."""

    def __init__(self, most_bytes, seconds, cap):
        super().__init__(seconds, doing="download", setting="TRAINYARD_DATA_DOWNLOAD_SECONDS")
        self.left, self.cap = most_bytes, cap

    def listed(self, total, label):
        """Refuse at once a listing that says more than is left."""
        if total > self.left:
            raise DataStoreError(f"{label} holds {format_bytes(total)}, more than the job's {self.cap} "
                                 f"({format_bytes(self.left)} left)")

    def take(self, count, label):
        self.left -= count
        if self.left < 0:
            raise DataStoreError(f"{label}: the download went past the job's {self.cap}; stopped")
        self.check_time(label)


@dataclass(frozen=True)
class StoredObject:
    key: str  # relative to the store's root, '/'-separated
    size: int


class LocalStore:
    """A directory tree. With `confined`, nothing outside the root is read or written: a key is
    checked to stay inside the root (path_of), then opened one folder at a time from the root without
    following a link (_Confined), never by its path. A link placed in a tenant's folder, or swapped in
    for a folder between the check and the open, cannot lead into another tenant's."""

    def __init__(self, root, *, name="local", confined=False):
        self.root = Path(root)
        self.name = name
        self.confined = confined

    def list(self, prefix=""):
        top = self.path_of(prefix)
        if not top.is_dir():
            raise DataStoreError(f"data store {self.name!r}: folder {prefix.rstrip('/') or '.'!r} does not exist")
        if self.confined:
            yield from _Confined(self).files(prefix)
            return
        for path in regular_files(top):
            yield StoredObject(_relative_posix(path, top, prefix), path.stat().st_size)

    def get(self, key, destination, allowance=None):
        label = f"data store {self.name!r}"
        if not self.confined:
            return _copy_file(self.path_of(key), destination, allowance, label=label)
        self.path_of(key)
        with _Confined(self).open(key) as source:
            _write(_blocks(source), destination, allowance, label=label)

    def put(self, source, key):
        """`source` (a file open for reading) written as `key`."""
        if not self.confined:
            return _write(_blocks(source), self.path_of(key))
        self.path_of(key)
        _Confined(self).write(_blocks(source), key)

    def cut(self):
        """Nothing to cut: reading and writing a local disk ends by itself."""

    def path_of(self, key, *, what=None):
        """The path of `key` ('' is the root); when confined, refused unless it stays inside the root.
        `what` names the key in the message (e.g. the manifest field it came from)."""
        path = self.root / key if key else self.root
        if not self.confined:
            return path
        root, resolved = self.root.resolve(), path.resolve()
        if resolved != root and root not in resolved.parents:
            raise DataStoreError(f"data store {self.name!r}: {what or repr(key)} leads outside the tenant's local "
                                 "data-store folder (through '..', an absolute path or a symbolic link); refused")
        if resolved != Path(os.path.normpath(root / key)):  # the same place only through a link
            raise DataStoreError(f"data store {self.name!r}: {what or repr(key)} goes through a symbolic link "
                                 "inside the tenant's local data-store folder; links there are not followed")
        return resolved


class _Confined:
    """Listing, reading and writing a confined LocalStore through file descriptors (_open_folder from
    the root, which is opened as the operator made it: it may be a link to a mount). A link anywhere
    below the root is refused or passed over, so what path_of checked is what is opened, whatever
    changes in the folders meanwhile."""

    def __init__(self, store):
        self.store = store

    def open(self, key):
        """The file `key`, open for reading (a plain file only)."""
        *folders, name = self._parts(key)
        folder = self._folder(folders)
        try:
            source = self._call(key, _open_plain, folder, name)
        finally:
            os.close(folder)
        if source is None:
            raise DataStoreError(f"data store {self.store.name!r}: {key!r} is not a plain file")
        return source

    def write(self, blocks, key):
        """`blocks` as `key`, through a temporary file beside it that goes when anything fails."""
        *folders, name = self._parts(key)
        # A name of its own, made new (O_EXCL): never a file someone left or linked there beforehand.
        tmp = f".tmp-{secrets.token_hex(8)}"
        self.store.root.mkdir(parents=True, exist_ok=True)  # the platform's path (DATA_DIR, a tenant's slug)
        folder = self._folder(folders, make=True)
        try:
            fd = self._call(key, os.open, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                            0o644, dir_fd=folder)
            try:
                with os.fdopen(fd, "wb") as out:
                    for block in blocks:
                        out.write(block)
                os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)  # replaces a link, never follows it
            except BaseException:
                with suppress(OSError):
                    os.unlink(tmp, dir_fd=folder)
                raise
        finally:
            os.close(folder)

    def files(self, prefix):
        """A StoredObject for every plain file under the folder `prefix`, in regular_files' order and
        within its depth. Each folder is opened afresh from the root like a key's (so no more than one
        descriptor is held however wide the tree), and a link met anywhere is passed over: a folder
        swapped for one meanwhile shows nothing of where it points, neither names nor sizes."""
        top = self._parts(prefix, folder=True)
        stack = [((), 0)]
        while stack:
            below, depth = stack.pop()
            try:
                folder = _open_folder(self.store.root, [*top, *below], top_may_be_link=True)
            except OSError:  # swapped for a link or gone meanwhile
                continue
            try:
                files, inner, _ = _sorted_entries(folder)
                found = [(entry.name, size) for entry in files if (size := _size(entry)) is not None]
            finally:
                os.close(folder)
            for name, size in found:
                yield StoredObject(PurePosixPath(prefix, *below, name).as_posix(), size)
            if depth < diskwatch.MAX_DEPTH:
                stack.extend(((*below, entry.name), depth + 1) for entry in reversed(inner))

    def _parts(self, key, *, folder=False):
        """The names on the way to `key`, a file's (or with `folder`, a folder's: '' is the root); never '..',
        which a folder swapped meanwhile could lead out through."""
        parts = [part for part in PurePosixPath(key).parts if part not in ("", ".", "/")]
        if (not parts and not folder) or ".." in parts:
            what = "a folder" if folder else "a file's key"
            raise DataStoreError(f"data store {self.store.name!r}: {key!r} is not {what} inside the store")
        return parts

    def _folder(self, parts, *, make=False):
        """_open_folder from the root, a refusal naming the folder the walk stopped at."""
        try:
            return _open_folder(self.store.root, parts, top_may_be_link=True, make=make)
        except OSError as exc:
            raise self._refusal(exc, "." if exc.filename == str(self.store.root) else exc.filename) from None

    def _call(self, key, call, *args, **kwargs):
        try:
            return call(*args, **kwargs)
        except OSError as exc:
            raise self._refusal(exc, key) from None

    def _refusal(self, exc, what):
        where = f"data store {self.store.name!r}"
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return DataStoreError(f"{where}: {what!r} is a symbolic link or not a folder; links inside a "
                                  "tenant's local data-store folder are not followed")
        if exc.errno == errno.ENOENT:
            return DataStoreError(f"{where}: {what!r} does not exist")
        return exc


class S3Store:
    """One bucket of an S3-compatible server. Timeouts and retries are short on purpose: a wrong
    endpoint or a dead server must fail the job at DOWNLOADING within seconds, not hang it.

    With an `egress` policy (a manifest's store: its endpoint is the researcher's choice), every
    connection goes through jobs.egress (public addresses only, unless the operator allows more),
    every way of not reaching the endpoint reads the same, and nothing of the platform's own AWS
    configuration is used: no AWS_* endpoint or credentials from the environment, no instance
    metadata; a store without credentials is read anonymously."""

    def __init__(self, bucket, *, endpoint=None, access_key=None, secret_key=None, session_token=None,
                 region=None, name="s3", egress=None):
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config
        self.bucket = bucket
        self.name = name
        self.egress = egress
        self._endpoint_checked = False
        self._cutter = _Cutter()
        self._bound = _AnswerBound()
        options = dict(connect_timeout=5, read_timeout=60, retries={"max_attempts": 3, "mode": "standard"},
                       s3={"addressing_style": "path"})
        if egress is not None:
            options["ignore_configured_endpoint_urls"] = True
            if not access_key:
                options["signature_version"] = UNSIGNED
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint or None, aws_access_key_id=access_key or None,
            aws_secret_access_key=secret_key or None, aws_session_token=session_token or None,
            region_name=region or "us-east-1", config=Config(**options))
        if egress is not None:
            _guard_connections(self.client, egress, self._cutter, self._bound)
            self.client.meta.events.register("before-call.s3", self._bound.before_call)

    def list(self, prefix=""):
        with self._errors("listing"):
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            for page in pages:
                for item in page.get("Contents", []):
                    if not item["Key"].endswith("/"):
                        yield StoredObject(item["Key"], item["Size"])

    def get(self, key, destination, allowance=None):
        """The object streamed into `destination`, counted against `allowance` as it arrives."""
        with self._errors(f"downloading {key}"):
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
            try:
                _write(body.iter_chunks(1024 * 1024), destination, allowance, label=f"data store {self.name!r}")
            finally:
                body.close()

    def put(self, source, key):
        """`source` (a file open for reading) uploaded as `key`."""
        with self._errors(f"uploading {key}"):
            self.client.upload_fileobj(source, self.bucket, key)

    def cut(self):
        """End every connection to the endpoint now, and open none again (from any thread)."""
        self._cutter.cut()

    def check_endpoint(self):
        """Refuse a disallowed endpoint before anything connects (also when a proxy would be used,
        where the connection-level check sees the proxy's address, not the endpoint's)."""
        if self.egress is not None and not self._endpoint_checked:
            url = urlparse(self.client.meta.endpoint_url)
            try:
                egress.checked_addresses(url.hostname or "", url.port or (443 if url.scheme == "https" else 80),
                                         self.egress)
            except egress.EndpointRefused:
                raise self._unreachable() from None
            self._endpoint_checked = True

    def _unreachable(self):
        return DataStoreError(f"data store {self.name!r}: {egress.UNREACHABLE}")

    @contextmanager
    def _errors(self, doing):
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError
        self.check_endpoint()
        try:
            yield
        except ClientError as exc:
            raise DataStoreError(f"data store {self.name!r}: {doing} in bucket {self.bucket!r} failed: "
                                 f"{_explain_client_error(exc)}") from None
        except (BotoCoreError, S3UploadFailedError) as exc:
            if _caused_by(exc, AnswerTooLong):
                raise DataStoreError(f"data store {self.name!r}: {doing} in bucket {self.bucket!r} failed: the "
                                     f"server's answer was longer than {format_bytes(MAX_ANSWER_BYTES)}; refused") from None
            if self.egress is not None and _no_connection(exc):
                raise self._unreachable() from None  # refused, timed out, not resolved: all read the same
            raise DataStoreError(f"data store {self.name!r}: {doing} in bucket {self.bucket!r} failed: {exc}") from None


def _no_connection(exc):
    """The failure (or what caused it: uploads wrap it) is a connection that could not be made or kept."""
    from botocore.exceptions import ConnectionError, HTTPClientError
    return _caused_by(exc, (ConnectionError, HTTPClientError))


def _caused_by(exc, kinds):
    cause = exc
    while cause is not None:
        if isinstance(cause, kinds):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


class AnswerTooLong(Exception):
    """A data store's server sent more than MAX_ANSWER_BYTES where no object's content was asked for."""


class _AnswerBound(threading.local):
    """Whether the call this thread makes now is an object download (its answer is streamed to disk
    and counted there), set by botocore's `before-call` event, which runs in the thread that then
    sends the request; every other answer is read within MAX_ANSWER_BYTES by the guarded pool."""
    streamed = True

    def before_call(self, model, **kwargs):
        self.streamed = model.has_streaming_output


def _read_within(response, method, url):
    """The answer `response` (urllib3's, unread) read whole within MAX_ANSWER_BYTES, as an answer
    of the same status and headers that botocore reads instead; AnswerTooLong past the bound."""
    from urllib3.response import HTTPResponse
    body = response.read(MAX_ANSWER_BYTES + 1, decode_content=False)
    if len(body) > MAX_ANSWER_BYTES:
        response.close()  # the rest is never read: the connection cannot be used again
        raise AnswerTooLong(f"an answer over {MAX_ANSWER_BYTES} bytes")
    response.release_conn()
    return HTTPResponse(body=io.BytesIO(body), headers=response.headers, status=response.status,
                        version=response.version, reason=response.reason, preload_content=False,
                        decode_content=False, enforce_content_length=False, request_method=method,
                        request_url=url)


class _Cutter:
    """The connections a store's guarded pools opened, each with a duplicate of its socket kept
    here, so that `cut()` can shut them all down from another thread: a server trickling a byte at a
    time stays under every read timeout (the TLS handshake's too) and would hold a worker as long as
    it likes. Once cut, no connection opens."""

    def __init__(self):
        self._lock = threading.Lock()
        self._spares = set()
        self._cut = False

    def opened(self, sock):
        """The spare of a freshly connected `sock`, to hand back to `closed`; OSError once cut."""
        with self._lock:
            if self._cut:
                raise OSError("the data store's connections were cut")
            spare = sock.dup()
            self._spares.add(spare)
            return spare

    def closed(self, spare):
        with self._lock:
            self._spares.discard(spare)
            spare.close()

    def cut(self):
        with self._lock:  # shutting down under the lock: a spare closed meanwhile is never touched
            self._cut = True
            for spare in self._spares:
                try:
                    spare.shutdown(socket.SHUT_RDWR)  # wakes a read blocked on any descriptor of it
                except OSError:
                    pass


def _guard_connections(client, policy, cutter, bound):
    """Make every connection the client opens go through jobs.egress.connect (checked addresses only),
    kept by `cutter`, and every answer that `bound` says is no object's content read within
    MAX_ANSWER_BYTES (through the pools' public `urlopen`).

    botocore keeps its urllib3 pool classes in one dict shared by its pool and proxy managers, and
    creates pools lazily, so replacing the classes before the first request covers every connection.
    Fails loudly if botocore changes that layout, rather than running unguarded; pyproject.toml pins
    botocore and urllib3 to the versions checked, and jobs/tests/test_egress.py holds a canary."""
    from botocore.awsrequest import (AWSHTTPConnection, AWSHTTPConnectionPool, AWSHTTPSConnection,
                                     AWSHTTPSConnectionPool)
    classes = getattr(getattr(client._endpoint, "http_session", None), "_pool_classes_by_scheme", None)
    if not isinstance(classes, dict) or set(classes) != {"http", "https"}:
        raise RuntimeError("botocore's connection pools are not where jobs.datastores expects them; "
                           "data-store endpoints cannot be checked")
    classes["http"] = _guarded_pool(AWSHTTPConnectionPool, AWSHTTPConnection, policy, cutter, bound)
    classes["https"] = _guarded_pool(AWSHTTPSConnectionPool, AWSHTTPSConnection, policy, cutter, bound)


def _guarded_pool(pool_class, connection_class, policy, cutter, bound):
    from urllib3.exceptions import NewConnectionError

    class GuardedConnection(connection_class):
        spare = None  # the cutter's duplicate of this connection's socket

        def _new_conn(self):
            try:
                sock = egress.connect(self._dns_host, self.port, policy, timeout=self.timeout,
                                      source_address=self.source_address, socket_options=self.socket_options)
            except OSError as exc:
                raise NewConnectionError(self, egress.UNREACHABLE) from exc
            self._release_spare()
            try:
                self.spare = cutter.opened(sock)
            except OSError as exc:
                sock.close()
                raise NewConnectionError(self, str(exc)) from exc
            return sock

        def close(self):
            super().close()
            self._release_spare()

        def _release_spare(self):
            if self.spare is not None:
                cutter.closed(self.spare)
                self.spare = None

    def urlopen(self, method, url, *args, **kwargs):
        response = pool_class.urlopen(self, method, url, *args, **kwargs)
        # An error is read whole too, an object download's included.
        return response if bound.streamed and response.status < 300 else _read_within(response, method, url)

    return type(f"Guarded{pool_class.__name__}", (pool_class,), {"ConnectionCls": GuardedConnection,
                                                                  "urlopen": urlopen})


def transfer_failures():
    """What a transfer may fail with because of what its manifest or its data store holds: told to
    its job (which fails) rather than retried for ever. Beside DataStoreError: an endpoint or region
    boto refuses (ValueError, BotoCoreError), a key or file name the file system cannot hold, a
    full disk (OSError), a name that is not text (UnicodeError)."""
    from botocore.exceptions import BotoCoreError
    return DataStoreError, BotoCoreError, OSError, ValueError, UnicodeError


def failure_text(exc):
    """A transfer failure as its job's reason and log line say it: at most MAX_REASON characters (a
    data store's server wrote part of it)."""
    text = str(exc) if isinstance(exc, DataStoreError) else f"{type(exc).__name__}: {exc}"
    return text[:MAX_REASON]


def _explain_client_error(exc):
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidClientTokenId", "403", "AccessDenied"):
        return (f"the server refused the credentials ({code}); check the connection's user_name (access "
                "key id) and password (secret key), and that they may read/write this bucket")
    if code in ("NoSuchBucket", "404"):
        return f"the bucket does not exist ({code})"
    return f"{code[:60]}: {str(error.get('Message', ''))[:MAX_SERVER_TEXT]}".strip(": ")


def _relative_posix(path, top, prefix):
    """The key of a file found under `top` (the folder of `prefix`), even when `top` was resolved."""
    return (PurePosixPath(prefix) / path.relative_to(top).as_posix()).as_posix()


def _copy_file(source, destination, allowance=None, *, label=""):
    with open(source, "rb") as src:
        _write(_blocks(src), destination, allowance, label=label)


def _blocks(file):
    return iter(lambda: file.read(1024 * 1024), b"")


def _write(blocks, destination, allowance=None, *, label=""):
    """`blocks` into `destination` through a temporary file beside it, which goes when anything fails."""
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    tmp = destination.with_name(f".tmp-{destination.name}")
    try:
        with open(tmp, "wb") as out:
            for block in blocks:
                if allowance is not None:
                    allowance.take(len(block), label)
                out.write(block)
        os.replace(tmp, destination)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --- the manifest's stores ---------------------------------------------------------------------
@dataclass(frozen=True)
class Location:
    """A store and a key prefix in it: where a manifest's training_data or training_results are."""
    store: object
    prefix: str
    label: str  # for messages: "data store 'store1' (s3 bucket my-data)"


def split_container(container):
    bucket, _, prefix = container.partition("/")
    return bucket, prefix.strip("/")


def local_root(data_root, tenant):
    """The folder a tenant's `type: local` stores name their containers in: one per tenant, so one
    tenant's jobs never read or write another's."""
    return Path(data_root) / LOCAL_STORES_DIR / tenant


def location(spec, section, credentials, *, data_root, tenant, egress):
    """The Location of `spec[section]` (training_data or training_results) of one manifest data store
    of a job of `tenant`; S3 endpoints are held to the `egress` policy (jobs.egress.EgressPolicy)."""
    container = spec[section]["container"]
    store_id = spec["id"]
    if spec["type"] == "local":
        store = LocalStore(local_root(data_root, tenant), name=store_id, confined=True)
        store.path_of(container, what=f"{section}.container {container!r}")  # refused before any transfer
        return Location(store, container, f"data store {store_id!r} (folder {container})")
    bucket, prefix = split_container(container)
    connection = spec.get("connection") or {}
    secret = credentials.get(store_id, {})
    store = S3Store(bucket, endpoint=connection.get("auth_url"), region=connection.get("region"),
                    access_key=secret.get("user_name") or secret.get("access_key_id"),
                    secret_key=secret.get("password") or secret.get("secret_access_key"),
                    session_token=secret.get("session_token"), name=store_id, egress=egress)
    return Location(store, prefix, f"data store {store_id!r} (bucket {bucket})")


# --- transfers ---------------------------------------------------------------------------------
def _transfer(items, move, report, doing):
    """move(item) for each (item, size) of `items`, saying how far it got through `report(line)` at the
    start, about every PROGRESS_EVERY_S seconds, and at the end; (files, bytes) in all."""
    total, done = sum(size for _, size in items), 0

    def say(count, final=False):
        percent = "done" if final else f"{100 * done / total if total else 100.0:.0f}%"
        report(f"[trainyard] {doing}: {count}/{len(items)} files, {format_bytes(done)}/{format_bytes(total)} "
               f"({percent})")

    say(0)
    said = time.monotonic()
    for count, (item, size) in enumerate(items, 1):
        move(item)
        done += size
        if time.monotonic() - said >= PROGRESS_EVERY_S:
            say(count)
            said = time.monotonic()
    say(len(items), final=True)
    return len(items), total


def fetch(source, destination, *, report=lambda line: None, allowance=None):
    """Download every object under source.prefix into `destination`, keeping relative paths, within
    `allowance` (an Allowance, shared by every store of the job) when given: past its deadline the
    store's connections are cut, whatever the server is sending, and the download fails saying so."""
    if allowance is None:
        return _fetch(source, Path(destination), report, None)
    with _cut_past(allowance, source):
        return _fetch(source, Path(destination), report, allowance)


@contextmanager
def _cut_past(deadline, location):
    """The block, with the location's store cut once `deadline` (a Deadline) passes: a server
    trickling its answers or reading slowly holds a shared worker no longer. Whatever the cut made
    the store fail with reads as the deadline passed."""
    cutting = threading.Timer(max(0.0, deadline.deadline - time.monotonic()), location.store.cut)
    cutting.daemon = True
    cutting.start()
    try:
        yield
    except Exception:
        if deadline.past_deadline():
            deadline.check_time(location.label)
        raise
    finally:
        cutting.cancel()


def _listed(source, folder, allowance):
    """The objects under `folder`, within MAX_OBJECTS, MAX_KEY_BYTES a key and the allowance's time."""
    objects = []
    for obj in source.store.list(folder):
        if len(objects) == MAX_OBJECTS:
            raise DataStoreError(f"{source.label} holds more than {MAX_OBJECTS:,} objects under {folder!r}, "
                                 "more than one download takes; pack the data into fewer, larger objects")
        if len(obj.key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
            raise DataStoreError(f"{source.label}: object {obj.key[:100]!r} has a key longer than "
                                 f"{MAX_KEY_BYTES} bytes; refused")
        if allowance is not None:
            allowance.check_time(source.label)
        objects.append(obj)
    return objects


def _fetch(source, destination, report, allowance):
    # The prefix is a folder: `inputs` is not `inputs-old/` (a key prefix alone would match both).
    folder = source.prefix.strip("/") + "/" if source.prefix.strip("/") else ""
    objects = _listed(source, folder, allowance)
    if allowance is not None:
        allowance.listed(sum(o.size for o in objects), source.label)

    def get(obj):
        relative = obj.key.removeprefix(folder)
        if PurePosixPath(relative).name == FETCHED_MARK:  # the platform's own mark of a complete download
            raise DataStoreError(f"{source.label}: object {obj.key!r} has a name the platform keeps for itself")
        target = (destination / relative.lstrip("/")).resolve()
        if destination.resolve() not in target.parents:
            raise DataStoreError(f"{source.label}: object {obj.key!r} would land outside DATA_DIR; refused")
        source.store.get(obj.key, target, allowance)

    return _transfer([(obj, obj.size) for obj in objects], get, report, f"downloading from {source.label}")


def push(folders, target, *, report=lambda line: None, deadline=None):
    """Upload every regular file of each {name: folder} under target.prefix/name/, within `deadline`
    (a Deadline, shared by every target of the job) when given. Links are never followed: those
    found, and files that turn out to be links or no plain files when opened, are left out, and one
    line through `report` names them."""
    files, left_out = [], []
    for name, folder in folders.items():
        folder = Path(folder)
        if folder.is_symlink():
            left_out.append(name)
            continue
        if not folder.is_dir():
            continue
        for path in regular_files(folder, links=left_out, named_from=folder.parent):
            if not path.name.startswith(".tmp"):
                relative = path.relative_to(folder)
                key = str(PurePosixPath(target.prefix, name, relative.as_posix())).lstrip("/")
                files.append(((folder, relative, key), path.lstat().st_size))

    def put(file):
        folder, relative, key = file
        if deadline is not None:
            deadline.check_time(target.label)
        source = _open_below(folder, relative)
        if source is None:
            left_out.append(f"{folder.name}/{relative.as_posix()}")
            return
        with source:
            target.store.put(source, key)

    if deadline is None:
        done = _transfer(files, put, report, f"uploading to {target.label}")
    else:
        with _cut_past(deadline, target):
            done = _transfer(files, put, report, f"uploading to {target.label}")
    if left_out:
        report(_left_out_line(target, left_out))
    return done


def _open_below(top, relative):
    """The file `relative` below the folder `top`, open for reading, never by its path (_open_folder;
    `top` may not be a link either): a learner's process left running can swap a link to any file of
    the platform's in for a listed one. None when one of them is a link or gone, or the file is no
    plain file."""
    try:
        folder = _open_folder(top, relative.parts[:-1])
        try:
            return _open_plain(folder, relative.parts[-1])
        finally:
            os.close(folder)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            return None
        raise


_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _open_folder(top, parts, *, top_may_be_link=False, make=False):
    """A descriptor of the folder top/parts/..., each folder below `top` opened relative to the one
    before without following a link (openat with O_NOFOLLOW), and made first when `make`; `top`
    itself likewise unless `top_may_be_link` (an operator's folder, which may be a link to a mount).
    A link or no folder on the way raises OSError (ELOOP or ENOTDIR) naming it as its filename."""
    folder = os.open(top, _FOLDER_FLAGS | (0 if top_may_be_link else os.O_NOFOLLOW))
    try:
        for part in parts:
            if make:
                with suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=folder)
            inner = os.open(part, _FOLDER_FLAGS | os.O_NOFOLLOW, dir_fd=folder)
            os.close(folder)
            folder = inner
    except BaseException:
        os.close(folder)
        raise
    return folder


def _open_plain(folder, name):
    """`name` in the folder descriptor `folder`, open for reading without following a link; None if
    it is no plain file (O_NONBLOCK: a FIFO does not hold the open)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=folder)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def _sorted_entries(folder):
    """(plain files, folders, links) in `folder` (a path, or a folder's descriptor), each a list of
    os.DirEntry sorted by name; an entry gone meanwhile is left out."""
    files, folders, links = [], [], []
    with os.scandir(folder) as listing:
        entries = sorted(listing, key=lambda entry: entry.name)
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                folders.append(entry)
            elif entry.is_file(follow_symlinks=False):
                files.append(entry)
            elif entry.is_symlink():
                links.append(entry)
        except OSError:
            continue
    return files, folders, links


def _size(entry):
    """The entry's size, not following a link; None when it went meanwhile."""
    try:
        return entry.stat(follow_symlinks=False).st_size
    except OSError:
        return None


def _left_out_line(target, names, shown=3):
    listed = ", ".join(repr(name[:200]) for name in names[:shown])
    more = f" and {len(names) - shown:,} more" if len(names) > shown else ""
    return (f"[trainyard] uploading to {target.label}: {len(names):,} symbolic links or other entries that are "
            f"not plain files were left out (a link is never followed): {listed}{more}")


def regular_files(top, *, links=None, named_from=None):
    """Every regular file under `top` (symlinks left out, so nothing outside is read; each one's path
    relative to `named_from`, else `top`, is added to the list `links` when given), in a stable
    order, folder by folder as os.walk goes. A learner can nest its folders thousands deep: those
    past diskwatch.MAX_DEPTH (whose learner that cap already failed) and unreadable ones are passed
    over, and the walk keeps a stack of its own (os.walk recursed once per level)."""
    stack = [(Path(top), 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            files, folders, found_links = _sorted_entries(folder)
        except OSError:
            continue
        if links is not None:
            links.extend(Path(entry.path).relative_to(named_from or top).as_posix() for entry in found_links)
        yield from (Path(entry.path) for entry in files)
        if depth < diskwatch.MAX_DEPTH:
            stack.extend((Path(entry.path), depth + 1) for entry in reversed(folders))


@contextmanager
def exclusive(lock_path):
    """Yield True while holding an exclusive lock on `lock_path`, False if someone else holds it.

    A re-driven deploy must not download the same data twice at once; the kernel drops the lock if
    the worker holding it dies, so the next re-drive starts over."""
    fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


# --- credentials -------------------------------------------------------------------------------
def credentials(raw):
    """{store id: {field: value}} of the secret connection fields of a parsed manifest mapping."""
    found = {}
    for store in (raw or {}).get("data_stores") or []:
        if not isinstance(store, dict):
            continue
        connection = store.get("connection") or {}
        secret = {k: str(v) for k, v in connection.items()
                  if k not in PUBLIC_CONNECTION_FIELDS and v not in (None, "", REDACTED)}
        if secret:
            found[str(store.get("id"))] = secret
    return found


def redact(raw):
    """A copy of a parsed manifest mapping with every credential replaced by REDACTED."""
    if not isinstance(raw, dict) or not isinstance(raw.get("data_stores"), list):
        return raw
    stores = []
    for store in raw["data_stores"]:
        if isinstance(store, dict) and isinstance(store.get("connection"), dict):
            connection = {k: (v if k in PUBLIC_CONNECTION_FIELDS or v in (None, "") else REDACTED)
                          for k, v in store["connection"].items()}
            store = dict(store, connection=connection)
        stores.append(store)
    return dict(raw, data_stores=stores)


# libyaml's loader where PyYAML was built with it: the same nodes and the same marks (character
# indexes), many times faster than the pure-Python one, and every job detail shown (REST,
# websockets, a waiting script's answer) is redacted this way.
_COMPOSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def redact_yaml(text):
    """The manifest text with each credential's value replaced in place (comments and layout kept).

    Positions come from the YAML node tree, so a secret is found however it is quoted or folded; a
    text that does not compose (never stored anyway) is returned unchanged."""
    try:
        root = yaml.compose(text, Loader=_COMPOSER)
    except yaml.YAMLError:
        return text
    spans = []
    stores = _value(root, "data_stores")
    for store in stores.value if isinstance(stores, yaml.SequenceNode) else []:
        connection = _value(store, "connection")
        if not isinstance(connection, yaml.MappingNode):
            continue
        for key, value in connection.value:
            if key.value not in PUBLIC_CONNECTION_FIELDS and isinstance(value, yaml.ScalarNode) and value.value:
                spans.append((value.start_mark.index, value.end_mark.index))
    for start, end in sorted(spans, reverse=True):
        text = text[:start] + f'"{REDACTED}"' + text[end:]
    return text


def _value(node, key):
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode) and k.value == key:
                return v
    return None


def _fernet(keys):
    """The credentials' cipher for `keys` (the secret key, then older ones): each sealed with a key of
    its own for this purpose derived from it (never the secret key itself); the first seals, any opens."""
    from cryptography.fernet import Fernet, MultiFernet
    if isinstance(keys, str):
        keys = [keys]
    return MultiFernet([Fernet(base64.urlsafe_b64encode(
        hashlib.sha256(b"trainyard.datastores.credentials\0" + key.encode()).digest())) for key in keys])


def seal_credentials(folder, secrets, *, keys):
    """Keep `secrets` encrypted in the job's folder (mode 0600); nothing is written when there are none.
    `keys`: the secret key, then any older ones still accepted (SECRET_KEY_FALLBACKS)."""
    if not secrets:
        return None
    path = Path(folder) / SEALED_FILE
    token = _fernet(keys).encrypt(json.dumps(secrets).encode())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(token)
    return path


def unseal_credentials(folder, *, keys):
    """The sealed secrets of a job, {} if it has none (or they were deleted because it ended)."""
    from cryptography.fernet import InvalidToken
    path = Path(folder) / SEALED_FILE
    try:
        token = path.read_bytes()
    except FileNotFoundError:
        return {}
    try:
        return json.loads(_fernet(keys).decrypt(token))
    except InvalidToken:
        raise DataStoreError("the job's data-store credentials cannot be decrypted (SECRET_KEY changed? "
                             "an old key belongs in TRAINYARD_SECRET_KEY_FALLBACKS)") from None


def delete_credentials(folder):
    Path(folder, SEALED_FILE).unlink(missing_ok=True)


# --- the platform's own storage (TRAINYARD_STORAGE_URL) ----------------------------------------
def platform_store(url):
    """The Location behind TRAINYARD_STORAGE_URL: file:///path or s3://bucket/prefix.

    s3:// takes its endpoint and credentials from the usual AWS_* variables (AWS_ENDPOINT_URL,
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION), as boto3 reads them."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return Location(LocalStore(parsed.path, name="platform"), "", f"platform storage {parsed.path}")
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise DataStoreError(f"TRAINYARD_STORAGE_URL {url!r} names no bucket (s3://bucket/prefix)")
        store = S3Store(parsed.netloc, endpoint=os.environ.get("AWS_ENDPOINT_URL"),
                        region=os.environ.get("AWS_DEFAULT_REGION"), name="platform")
        return Location(store, parsed.path.strip("/"), f"platform storage s3://{parsed.netloc}")
    raise DataStoreError(f"TRAINYARD_STORAGE_URL {url!r}: use file:///path or s3://bucket/prefix")
