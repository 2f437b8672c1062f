"""No request's body is read past its route's bound or for longer than REQUEST_READ_S
(portal.bodylimit), whoever sends it: driven through the platform's ASGI application itself."""
import asyncio

import pytest
from asgiref.sync import async_to_sync

from portal.asgi import application
from portal.bodylimit import _Reading

pytestmark = pytest.mark.django_db(transaction=True)
MiB = 2**20


@async_to_sync
async def post(path, chunks, *, length=None, stall=False):
    """POST `chunks` (bytes each, one ASGI message each) to `path`; (status, body bytes the app read).
    `stall`: after the chunks, the client sends nothing more."""
    headers = [(b"host", b"testserver"), (b"content-type", b"application/octet-stream")]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 5000), "server": ("testserver", 80)}
    pending, answer, taken = list(chunks), {}, [0]

    async def receive():
        if pending:
            chunk = pending.pop(0)
            taken[0] += len(chunk)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending) or stall}
        await asyncio.sleep(3600)  # a stalled client, or one waiting for its answer

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]

    await asyncio.wait_for(application(scope, receive, send), 30)
    return answer.get("status"), taken[0]


def test_a_content_length_past_the_bound_is_refused_before_a_byte_is_read():
    assert post("/login/", [b"x" * MiB], length=10 * 2**30) == (413, 0)


def test_a_body_that_grows_past_the_bound_is_cut_off(settings):
    settings.MAX_CODE_BYTES = MiB  # a code route takes the archive's bound and 8 MiB of form
    status, read = post("/api/v1/jobs/", [b"x" * MiB] * 40)
    assert status == 413 and read <= 10 * MiB
    status, read = post("/login/", [b"x" * MiB] * 40)  # elsewhere what Django takes of a body that is no file
    assert status == 413 and read <= settings.DATA_UPLOAD_MAX_MEMORY_SIZE + MiB


def test_a_body_that_stalls_is_answered_408(settings):
    settings.REQUEST_READ_S = 0.3
    assert post("/login/", [b"username=a"], stall=True) == (408, 10)


def test_a_body_within_bounds_reaches_django():
    status, _ = post("/login/", [b"username=a&password=b"])
    assert status == 403  # Django's own answer: no CSRF token


def test_once_the_body_is_in_the_deadline_no_longer_applies():
    # Django listens on receive for a disconnect while the view runs, however long that takes.
    async def scenario():
        async def receive():
            await asyncio.sleep(0.2)
            return {"type": "http.disconnect"} if reading.complete else \
                {"type": "http.request", "body": b"", "more_body": False}
        reading = _Reading(receive, limit=10, seconds=0.1)
        assert (await reading.receive())["type"] == "http.disconnect" and reading.refusal[0] == 408
        reading = _Reading(receive, limit=10, seconds=0.3)
        assert (await reading.receive())["type"] == "http.request" and reading.complete
        await asyncio.sleep(0.2)  # past the deadline
        assert (await reading.receive())["type"] == "http.disconnect" and reading.refusal is None
    asyncio.run(scenario())
