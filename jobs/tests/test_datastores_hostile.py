"""Downloads from and uploads to a hostile S3 endpoint: a real HTTP server (stdlib) that lists without
end, trickles its answers a byte at a time (under every read timeout), reads what it is sent slowly
or names keys no file may have. The job's download and upload times and its caps hold whatever the
server does."""
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from jobs import datastores
from jobs.datastores import Allowance, DataStoreError, Deadline, Location, S3Store
from jobs.egress import EgressPolicy

GIVES_UP_S = 15  # the hostile server's own end, so that a test of unguarded code fails instead of hanging
TRICKLE_S = 0.2  # between two bytes of a trickled answer: far under any read timeout
ENDLESS_PAGE_BYTES = 4 * datastores.MAX_ANSWER_BYTES


def listing(keys, truncated, token=""):
    contents = "".join(f"<Contents><Key>{key}</Key><Size>1</Size></Contents>" for key in keys)
    more = f"<NextContinuationToken>{token}</NextContinuationToken>" if truncated else ""
    return (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/'
            f'2006-03-01/"><Name>b</Name><Prefix>in/</Prefix><KeyCount>{len(keys)}</KeyCount><MaxKeys>1000'
            f'</MaxKeys><IsTruncated>{str(truncated).lower()}</IsTruncated>{more}{contents}'
            '</ListBucketResult>').encode()


class Hostile(BaseHTTPRequestHandler):
    """Serves bucket `b` as the server's `mode` says: `endless` (every listing page says there is
    another), `trickle-list` (a listing trickled), `trickle-body` (an object trickled), `keys` (a
    listing of the server's `keys`, each object one byte), `endless-page` (one listing page that
    goes on, as fast as it is read), `endless-error` (the same as an object's error answer), `trickle-answer` (an upload read whole, its answer trickled) or
    `slow-read` (an upload read a little at a time)."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        url, server = urlparse(self.path), self.server
        if time.monotonic() > server.ends:
            return self.answer(400, b"<Error><Code>GaveUp</Code><Message>the server gave up</Message></Error>")
        if url.path == "/b":  # a listing
            page = int(parse_qs(url.query).get("continuation-token", ["0"])[0])
            if server.mode == "endless":
                return self.answer(200, listing([f"in/p{page}-{i}" for i in range(1000)], True, str(page + 1)))
            if server.mode == "trickle-list":
                return self.trickle(listing(["in/a"], False))
            if server.mode == "endless-page":
                return self.endless_page()
            return self.answer(200, listing(server.keys, False))
        if server.mode == "trickle-body":
            return self.trickle(b"x" * 1000)
        if server.mode == "endless-error":
            return self.endless_page(status=500)
        return self.answer(200, b"x")

    def do_PUT(self):
        left = int(self.headers.get("Content-Length", "0"))
        while left > 0 and time.monotonic() < self.server.ends:
            left -= len(self.rfile.read(min(left, 64 * 1024 if self.server.mode == "slow-read" else left)))
            if self.server.mode == "slow-read":
                time.sleep(TRICKLE_S)
        if left > 0:
            self.close_connection = True
            return
        if self.server.mode == "trickle-answer":
            return self.trickle(b" " * 1000)
        return self.answer(200, b"")

    def answer(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def endless_page(self, status=200):
        """A page without a length, sent until the client hangs up (ENDLESS_PAGE_BYTES at most, so that
        a client without a bound fails on the cut page instead of filling the test machine's memory)."""
        self.send_response(status)
        self.send_header("Connection", "close")
        self.end_headers()
        entry = b"<Contents><Key>in/a</Key><Size>1</Size></Contents>" * 1000
        sent = 0
        try:
            self.wfile.write(listing([], False)[:-len(b"</ListBucketResult>")])
            while sent < ENDLESS_PAGE_BYTES and time.monotonic() < self.server.ends:
                self.wfile.write(entry)
                sent += len(entry)
        except OSError:
            pass
        self.close_connection = True

    def trickle(self, body):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            for byte in body:
                if time.monotonic() > self.server.ends:
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(TRICKLE_S)
        except OSError:  # the client hung up: what a cut connection looks like from here
            pass
        self.close_connection = True


@contextmanager
def hostile_server(mode, keys=("in/a",)):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    server.daemon_threads = True
    server.mode, server.keys, server.ends = mode, list(keys), time.monotonic() + GIVES_UP_S
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.ends = 0  # trickling handlers stop
        server.shutdown()
        server.server_close()


def download(endpoint, tmp_path, seconds):
    """fetch `in/` of bucket `b` with `seconds` to do it in, as a manifest's store (egress-guarded)."""
    store = S3Store("b", endpoint=endpoint, name="lake", egress=EgressPolicy(allowed=("127.0.0.1",)))
    allowance = Allowance(10 * 2**20, seconds, cap="data cap")
    return datastores.fetch(Location(store, "in", "data store 'lake'"), tmp_path / "data", allowance=allowance)


@pytest.mark.parametrize("mode", ["trickle-body", "trickle-list", "endless"])
def test_a_server_that_never_finishes_is_cut_off_at_the_download_deadline(tmp_path, mode):
    began = time.monotonic()
    with hostile_server(mode) as endpoint, pytest.raises(
            DataStoreError, match=r"took longer than 2s in all \(TRAINYARD_DATA_DOWNLOAD_SECONDS\)"):
        download(endpoint, tmp_path, seconds=2)
    assert time.monotonic() - began < 2 + 5  # the cut, then botocore's two retries (3 s of backoff at most), refused
    assert not any(path.is_file() for path in (tmp_path / "data").rglob("*"))  # no part of an object kept


@pytest.mark.parametrize(("mode", "doing"), [("endless-page", "listing"), ("endless-error", "downloading in/a")])
def test_an_answer_that_never_ends_is_refused_past_the_bound_on_an_answer(tmp_path, mode, doing):
    with hostile_server(mode) as endpoint, pytest.raises(
            DataStoreError, match=rf"data store 'lake': {doing} in bucket 'b' failed: the server's answer was "
                                  r"longer than 16.0 MiB; refused"):
        download(endpoint, tmp_path, seconds=60)


def test_a_listing_of_more_objects_than_a_job_may_download_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(datastores, "MAX_OBJECTS", 2500)
    with hostile_server("endless") as endpoint, pytest.raises(
            DataStoreError, match=r"data store 'lake' holds more than 2,500 objects under 'in/'"):
        download(endpoint, tmp_path, seconds=60)


def test_a_key_longer_than_s3_allows_is_refused_by_name(tmp_path):
    long_key = "in/" + "k" * 2000
    with hostile_server("keys", [long_key]) as endpoint, pytest.raises(
            DataStoreError, match=r"data store 'lake': object 'in/kkk.*' has a key longer than 1024 bytes; refused"):
        download(endpoint, tmp_path, seconds=60)


def upload(endpoint, tmp_path, seconds):
    """push a 4 MiB results/ to bucket `b` with `seconds` to do it in, as a manifest's store."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "model.bin").write_bytes(b"m" * 4 * 2**20)
    store = S3Store("b", endpoint=endpoint, name="shelf", egress=EgressPolicy(allowed=("127.0.0.1",)))
    deadline = Deadline(seconds, doing="upload", setting="TRAINYARD_RESULT_UPLOAD_SECONDS")
    return datastores.push({"results": tmp_path / "results"}, Location(store, "out", "data store 'shelf'"),
                           deadline=deadline)


@pytest.mark.parametrize("mode", ["trickle-answer", "slow-read"])
def test_an_upload_to_a_server_that_never_finishes_is_cut_off_at_its_deadline(tmp_path, mode):
    began = time.monotonic()
    with hostile_server(mode) as endpoint, pytest.raises(
            DataStoreError, match=r"took longer than 2s in all \(TRAINYARD_RESULT_UPLOAD_SECONDS\)"):
        upload(endpoint, tmp_path, seconds=2)
    assert time.monotonic() - began < 2 + 5


def test_an_upload_within_its_deadline_is_pushed(tmp_path):
    with hostile_server("keys") as endpoint:
        assert upload(endpoint, tmp_path, seconds=60) == (1, 4 * 2**20)


RESULTS_TO_S3 = """
name: s3-results
framework: {{name: custom, command: sh run.sh}}
data_stores:
  - id: shelf
    type: s3_datastore
    training_results: {{container: results/out}}
    connection: {{auth_url: "{endpoint}"}}
"""


@pytest.mark.django_db
def test_a_result_store_that_never_finishes_fails_the_push_naming_the_setting(settings):
    from jobs import runtime, storage, transfers
    from jobs.models import LogLine
    from tests.support.builders import job, member
    from trainyard.manifest import parse_manifest

    settings.RESULT_UPLOAD_SECONDS = 2
    settings.DATASTORE_ALLOWED_HOSTS = ["127.0.0.1"]
    with hostile_server("trickle-answer") as endpoint:
        text = RESULTS_TO_S3.format(endpoint=endpoint)
        target = job(member(), manifest_yaml=text, runtime=runtime.from_manifest(parse_manifest(text)))
        results = storage.job_dir(target.tenant.slug, target.id) / "results"
        results.mkdir(parents=True)
        (results / "model.bin").write_bytes(b"m" * 1000)
        began = time.monotonic()
        failure = transfers.push_results(target, runtime.of(target))
        assert time.monotonic() - began < 2 + 5
    assert failure == ("data store 'shelf' (bucket results): the upload took longer than 2s in all "
                       "(TRAINYARD_RESULT_UPLOAD_SECONDS); stopped")
    assert LogLine.objects.filter(job=target, stream="system", line=f"[trainyard] {failure}").exists()
