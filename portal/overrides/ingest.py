"""The ingest endpoint served beside Django's request stack, on threads of its own.

Why kept: every agent posts here about once a second, so ingest is most of what a web process
does; through Django's ASGI handler each post runs the whole middleware stack and hops between the
event loop and a thread several times. Here a post goes straight to its view in a pool of threads.
It relies on ASGIHandler's create_request and send_response and on
django.core.handlers.exception.response_for_exception (undocumented; tests/test_canary.py), and on a
connection reading CONN_MAX_AGE and CONN_HEALTH_CHECKS from its own settings_dict when it connects
(tests/test_ingest.py fails where it stops).

A post to /api/v1/ingest/<job id>/ reaches the same view as through Django (jobs.api.ingest_view:
its throttling, credential check and batch), in a pool of INGEST_THREADS threads, so posts overlap
each other's waits on PostgreSQL and Redis. What the skipped middleware gave it is done here: the
Host is validated (a name the platform does not answer as gets a 400), the request signals run
(they close the thread's database connection past its age or after an error), and an error is
answered as Django answers it.
The route in portal/urls.py stays, for the test client and `reverse`; both reach the one view.

The body is read here, within the bounds portal.bodylimit, in front of every HTTP route, holds it
to (DATA_UPLOAD_MAX_MEMORY_SIZE, arriving within INGEST_READ_S: past either it tells this route the
client left, and answers 413 or 408 itself). Before any of it is read, the credential is checked on a
pool thread (`admit`): a caller without one is answered as the view answers it (401, 410, a
throttled 429) and costs the platform no reading at all. A post answered before its body was read to
the end closes its connection: the rest of the body would otherwise be read, only to be discarded.

Each tenant has a share of the pool (`Shares`): at most INGEST_TENANT_THREADS of its posts are read
and served at once (half the pool by default), so another tenant's post always finds a thread free,
however big and many one tenant's batches are. A post past its tenant's share waits its turn on the
event loop, holding no thread and unread, in order of arrival; one that has not had it within
TURN_WAIT_S (well within an agent's 30 s timeout) is answered 503 with Retry-After, which the agent
retries like any 503, keeping its records.

The pool's threads live as long as the process, so each keeps its database connection from one post
to the next (INGEST_KEEP_CONNECTION_S, checked before each post as CONN_HEALTH_CHECKS checks it),
where a request in Django's stack runs in a thread of its own and opens one per request. A post then
costs no login to PgBouncer, whose SCRAM exchange is a key derivation on both ends, and no session
reset.
"""
import asyncio
import collections
import gc
import io
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.exception import response_for_exception
from django.db import DEFAULT_DB_ALIAS, connections
from django.http import JsonResponse

PATH = re.compile(r"/api/v1/ingest/(?P<job_id>[^/\x00]+)/")  # a NUL goes through Django: a 400 naming it
TURN_WAIT_S = 10.0  # the longest a post waits for its tenant's turn in the pool before a 503


def ingest_threads():
    """PostgreSQL takes concurrent batches (each locks only its own job's row); SQLite has one writer
    at a time, so its posts take turns in one thread rather than in its busy timeout."""
    return 1 if settings.DATABASES["default"]["ENGINE"].endswith("sqlite3") else settings.INGEST_THREADS


def pool():
    """The threads ingest posts run in."""
    return ThreadPoolExecutor(max_workers=ingest_threads(), thread_name_prefix="ingest", initializer=keep_connection)


def tenant_threads():
    """How many posts of one tenant the pool serves at once: INGEST_TENANT_THREADS, by default half the
    pool (at least one)."""
    return settings.INGEST_TENANT_THREADS or max(1, ingest_threads() // 2)


def keep_connection():
    """The pool threads' initializer: this thread's connection outlives a post (up to
    INGEST_KEEP_CONNECTION_S) and is checked before it serves the next. Django's request signals, which
    close a connection past its age or after an error, still run around each post."""
    connection = connections[DEFAULT_DB_ALIAS]
    if connection.settings_dict["CONN_MAX_AGE"] is not None:  # None: kept for good already (SQLite)
        connection.settings_dict = {**connection.settings_dict, "CONN_HEALTH_CHECKS": True,
                                    "CONN_MAX_AGE": settings.INGEST_KEEP_CONNECTION_S}


class IngestRoute:
    """ASGI: ingest posts on the pool's threads, everything else to `django` (its ASGIHandler, whose
    request building and response sending serve the posts too; their bodies are read here, bounded)."""

    def __init__(self, django):
        self.django = django
        self.executor = pool()
        self.shares = Shares(tenant_threads())

    async def __call__(self, scope, receive, send):
        match = PATH.fullmatch(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None:
            return await self.django(scope, receive, send)
        job_id = match["job_id"]
        tenant, answer = await self._in_pool(self._admit, scope, job_id)
        if answer is None and not await self.shares.take(tenant, TURN_WAIT_S):
            answer = tenant_busy()
        if answer is not None:  # the body is left unread
            answer["Connection"] = "close"
            return await self.django.send_response(answer, send)
        try:
            response = await self._serve(scope, receive, job_id)
        except RequestAborted:  # the agent went away (it posts the batch again), or bodylimit refused it
            return
        finally:
            self.shares.give_back(tenant)
        if response.status_code == 503:
            response.setdefault("Retry-After", retry_after())
        await self.django.send_response(response, send)

    async def _serve(self, scope, receive, job_id):
        """The view's answer to the post, its body read first."""
        body = await read_body(receive)
        try:
            request, error = self.django.create_request(scope, body)
            return error or await self._in_pool(respond, request, job_id)
        finally:
            body.close()

    def _admit(self, scope, job_id):
        """(tenant, None) when the post's credential may post to the job, a job of `tenant`; else
        (None, the view's answer to the post without its body): the credential is the view's first
        concern, so the body is never read."""
        request, error = self.django.create_request(scope, io.BytesIO())
        return (None, error) if error else admit(request, job_id)

    async def _in_pool(self, function, *args):
        return await sync_to_async(function, thread_sensitive=False, executor=self.executor)(*args)

    def close(self):
        """Stop the pool's threads and close the connections they kept (a test suite does this before
        it drops its database). A dead thread's connection closes once its wrapper is collected."""
        self.executor.shutdown(wait=True)
        gc.collect()
        self.executor = pool()
        self.shares = Shares(tenant_threads())


class Shares:
    """Turns in the pool, `share` at a time per tenant: past them a post waits on the event loop (a
    future, not a thread), its tenant's waiting posts served in order of arrival as turns come back."""

    def __init__(self, share):
        self.share = share
        self.serving = collections.Counter()  # tenant -> posts holding a turn
        self.waiting = collections.defaultdict(collections.deque)  # tenant -> futures of posts waiting

    async def take(self, tenant, wait_s):
        """True once the post has a turn (give it back with give_back); False if none came in wait_s."""
        if self.serving[tenant] < self.share:
            self.serving[tenant] += 1
            return True
        turn = asyncio.get_running_loop().create_future()
        queue = self.waiting[tenant]
        queue.append(turn)
        try:
            await asyncio.wait_for(turn, wait_s)  # give_back hands a turn over by setting the result
        except asyncio.TimeoutError:
            pass  # unless the turn came just as the time ran out
        except BaseException:  # the post was cancelled: a turn handed to it goes on to the next one
            if turn.done() and not turn.cancelled():
                self.give_back(tenant)
            raise
        finally:
            if turn in queue:
                queue.remove(turn)
            if not queue and self.waiting.get(tenant) is queue:
                del self.waiting[tenant]
        return turn.done() and not turn.cancelled()

    def give_back(self, tenant):
        """End a turn: the next post of the tenant still waiting has it, else the tenant has one less."""
        queue = self.waiting.get(tenant, ())
        while queue:
            turn = queue.popleft()
            if not turn.done():  # not timed out or cancelled meanwhile
                turn.set_result(None)
                return
        if self.serving[tenant] > 1:
            self.serving[tenant] -= 1
        else:
            self.serving.pop(tenant, None)


def tenant_busy():
    """The answer to a post that did not get its tenant's turn within TURN_WAIT_S."""
    response = JsonResponse({"detail": "this tenant's posts fill its share of ingest; retry"}, status=503)
    response["Retry-After"] = retry_after()
    return response


def respond(request, job_id):
    """One post, as Django would serve it: request signals around the view (they close this thread's
    database connection past its age or after an error), the Host checked as CommonMiddleware checks
    it, and an exception answered by Django's own handling."""
    from jobs.api import ingest_view
    with as_a_request():
        try:
            request.get_host()  # DisallowedHost: a 400, as for every other request to a name not ours
            return ingest_view(request, job_id)
        except Exception as exc:  # noqa: BLE001 - Django turns it into the response it would send
            return response_for_exception(request, exc)


def retry_after():
    """When to post again after a 503: the job was busy (jobs.ingest.LOCK_WAIT_S); the view's answer
    carries no header, so the route adds it."""
    from jobs.ingest import RETRY_AFTER_S
    return str(RETRY_AFTER_S)


def admit(request, job_id):
    """(the job's tenant, None) when the credential of `request` is good for a live attempt of
    `job_id`, so its body is worth reading; else (None, what the view answers the post without its
    body). An agent's credential is remembered by the process (jobs.credentials), so for it this costs
    no query."""
    from jobs import credentials
    header = request.headers.get("Authorization", "")
    token = header[len("Ingest "):] if header.startswith("Ingest ") else None
    with as_a_request():
        grant = credentials.check(token, job_id)
    if grant is not None and not grant.ended:
        return grant.tenant_id, None
    return None, respond(request, job_id)


@contextmanager
def as_a_request():
    """Django's request signals around database work on a pool thread, as around a request."""
    signals.request_started.send(sender=IngestRoute)
    try:
        yield
    finally:
        signals.request_finished.send(sender=IngestRoute)


async def read_body(receive):
    """The post's body as a file, as ASGIHandler.read_body reads it (a big one spooled to a file rather
    than held in memory); RequestAborted when the client goes away."""
    body = tempfile.SpooledTemporaryFile(max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE, mode="w+b")
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise RequestAborted()
            body.write(message.get("body", b""))
            if not message.get("more_body", False):
                break
    except BaseException:
        body.close()
        raise
    body.seek(0)
    return body
