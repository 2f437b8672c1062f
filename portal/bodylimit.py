"""Every HTTP request's body, bounded before Django reads it.

Django's ASGI handler reads a request's whole body (past FILE_UPLOAD_MAX_MEMORY_SIZE into a temporary
file) before any middleware or view sees the request. Without a bound here anyone, signed in or not,
could make the web process keep gigabytes on its disk, or hold a connection by sending a byte a
minute. So a Content-Length over the route's bound is refused (413) before a byte is read, a body
that grows past it (chunked) is cut off with a 413, and one that has not all arrived within the
route's time is answered 408. The bound is the code archive's (MAX_CODE_BYTES and room for the
manifest and the form around it) on the routes that take one, DATA_UPLOAD_MAX_MEMORY_SIZE (what
Django takes of a body that is no file) elsewhere; the time is INGEST_READ_S for agents' posts (a
batch is small and sent whole), REQUEST_READ_S for the rest.
"""
import asyncio
import json
import re

from django.conf import settings

# The routes a code archive is posted to: the REST API's jobs and experiments, the pages' forms.
UPLOAD_PATHS = re.compile(r"/(api/v1/jobs/|api/v1/experiments/|submit/|experiments/new/)")
INGEST_PATH = re.compile(r"/api/v1/ingest/[^/]+/")  # agents' posts (portal.overrides.ingest)
FORM_ROOM = 8 * 2**20  # the manifest and the multipart form around the archive


def limit_for(path):
    if UPLOAD_PATHS.fullmatch(path):
        return settings.MAX_CODE_BYTES + FORM_ROOM
    return settings.DATA_UPLOAD_MAX_MEMORY_SIZE


def seconds_for(path):
    return settings.INGEST_READ_S if INGEST_PATH.fullmatch(path) else settings.REQUEST_READ_S


class BodyLimit:
    """ASGI middleware: HTTP requests reach `app` only with a body within limit_for(path), arriving
    within REQUEST_READ_S; anything else passes as it is."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = limit_for(scope["path"])
        length = _content_length(scope)
        if length is not None and length > limit:
            return await refuse(send, 413, _too_large(limit))
        reading = _Reading(receive, limit, seconds_for(scope["path"]))

        async def tracked_send(message):
            if message["type"] == "http.response.start":
                reading.answered = True
            await send(message)
        await self.app(scope, reading.receive, tracked_send)
        if reading.refusal and not reading.answered:
            await refuse(send, *reading.refusal)


class _Reading:
    """The request's receive, bounded while its body arrives: past the limit or the deadline the app
    is told the client left (Django then stops reading and answers nothing), and `refusal` says
    what to answer instead. Once the body is in, receive passes through: Django keeps listening
    on it for a disconnect while the view runs."""

    def __init__(self, receive, limit, seconds):
        self._receive, self._limit, self._seconds = receive, limit, seconds
        self._deadline = asyncio.get_running_loop().time() + seconds
        self.read, self.complete, self.refusal, self.answered = 0, False, None, False

    async def receive(self):
        if self.refusal:
            return {"type": "http.disconnect"}
        if self.complete:
            return await self._receive()
        left = self._deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(self._receive(), max(left, 0))
        except asyncio.TimeoutError:
            self.refusal = (408, f"the request's body did not arrive within {self._seconds:g} s")
            return {"type": "http.disconnect"}
        if message["type"] == "http.request":
            self.read += len(message.get("body", b""))
            if self.read > self._limit:
                self.refusal = (413, _too_large(self._limit))
                return {"type": "http.disconnect"}
            self.complete = not message.get("more_body", False)
        return message


def _content_length(scope):
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _too_large(limit):
    return f"the request's body is larger than {limit // 2**20} MiB, the most this route takes"


async def refuse(send, status, detail):
    """Answer `status` with {"detail": detail}, without reading the request's body."""
    body = json.dumps({"detail": detail}).encode()
    # The rest of the body is not read: the connection closes after the answer.
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
