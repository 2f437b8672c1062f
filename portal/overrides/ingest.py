"""The ingest endpoint served beside Django's request stack, on threads of its own.

Why kept: every agent posts here about once a second, so ingest is most of what a web process
does; through Django's ASGI handler each post runs the whole middleware stack and hops between the
event loop and a thread several times. Here a post goes straight to its view in a pool of threads.
It relies on ASGIHandler's read_body, create_request and send_response and on
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

The pool's threads live as long as the process, so each keeps its database connection from one post
to the next (INGEST_KEEP_CONNECTION_S, checked before each post as CONN_HEALTH_CHECKS checks it),
where a request in Django's stack runs in a thread of its own and opens one per request. A post then
costs no login to PgBouncer, whose SCRAM exchange is a key derivation on both ends, and no session
reset.
"""
import gc
import re
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.exception import response_for_exception
from django.db import DEFAULT_DB_ALIAS, connections

PATH = re.compile(r"/api/v1/ingest/(?P<job_id>[^/\x00]+)/")  # a NUL goes through Django: a 400 naming it


def ingest_threads():
    """PostgreSQL takes concurrent batches (each locks only its own job's row); SQLite has one writer
    at a time, so its posts take turns in one thread rather than in its busy timeout."""
    return 1 if settings.DATABASES["default"]["ENGINE"].endswith("sqlite3") else settings.INGEST_THREADS


def pool():
    """The threads ingest posts run in."""
    return ThreadPoolExecutor(max_workers=ingest_threads(), thread_name_prefix="ingest", initializer=keep_connection)


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
    body reading, request building and response sending serve the posts too)."""

    def __init__(self, django):
        self.django = django
        self.executor = pool()

    async def __call__(self, scope, receive, send):
        match = PATH.fullmatch(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None:
            return await self.django(scope, receive, send)
        try:
            body = await self.django.read_body(receive)
        except RequestAborted:  # the agent went away; it posts the batch again
            return
        request, error = self.django.create_request(scope, body)
        response = error or await sync_to_async(respond, thread_sensitive=False, executor=self.executor)(
            request, match["job_id"])
        body.close()
        await self.django.send_response(response, send)

    def close(self):
        """Stop the pool's threads and close the connections they kept (a test suite does this before
        it drops its database). A dead thread's connection closes once its wrapper is collected."""
        self.executor.shutdown(wait=True)
        gc.collect()
        self.executor = pool()


def respond(request, job_id):
    """One post, as Django would serve it: request signals around the view (they close this thread's
    database connection past its age or after an error), the Host checked as CommonMiddleware checks
    it, and an exception answered by Django's own handling."""
    from jobs.api import ingest_view
    signals.request_started.send(sender=IngestRoute)
    try:
        request.get_host()  # DisallowedHost: a 400, as for every other request to a name not ours
        return ingest_view(request, job_id)
    except Exception as exc:  # noqa: BLE001 - Django turns it into the response it would send
        return response_for_exception(request, exc)
    finally:
        signals.request_finished.send(sender=IngestRoute)
