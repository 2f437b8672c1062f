"""Which event loop of this process's ASGI server (daphne) the current thread serves, if any."""
import os

from asgiref.sync import SyncToAsync


def serving_loop():
    """The running event loop of the ASGI server whose synchronous code this thread runs (asgiref
    records it in each such thread: a request's view, a consumer's database call), or None (a
    Celery worker, a management command, a test's client, the ingest route's own threads)."""
    local = SyncToAsync.threadlocal
    loop = getattr(local, "main_event_loop", None)
    if loop is None or getattr(local, "main_event_loop_pid", None) != os.getpid() or not loop.is_running():
        return None
    return loop
