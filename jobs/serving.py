"""Which event loop of the ASGI server the running code serves, if any: a request's thread hands its
live updates to that loop (jobs.live) instead of waiting for them to leave.

The server's application is wrapped in ServingLoop (portal.asgi), which records the loop in a context
variable; asgiref carries context variables into the threads that run a request's synchronous code,
so a view, a consumer's database call or an ingest post sees it, and a Celery worker or a management
command does not.
"""
import asyncio
from contextvars import ContextVar

from asgiref.sync import sync_to_async

_loop = ContextVar("serving_loop", default=None)


class ServingLoop:
    """ASGI middleware: the wrapped application, and the threads it runs code in, see this loop."""

    def __init__(self, application):
        self.application = application

    async def __call__(self, scope, receive, send):
        _loop.set(asyncio.get_running_loop())  # this connection's task only: tasks copy their context
        return await self.application(scope, receive, send)


def serving_loop():
    """The running event loop of the ASGI server whose code this is, or None."""
    loop = _loop.get()
    return loop if loop is not None and loop.is_running() else None


class SentAsRead:
    """`chunks` (a synchronous iterator: a file's blocks, a query's batches) as the asynchronous iterable
    Django's documentation asks a StreamingHttpResponse served over ASGI to be given: each chunk is made
    in the request's own thread, and only once the one before has been sent. Given a synchronous one,
    Django reads it whole into memory before sending a byte, so a few downloads of a checkpoint or a long
    log at once would hold all of them in the web process. The response calls `close` once it is done
    with it, sent or not (`close`: what to call then; by default the iterator's own close, if any)."""

    def __init__(self, chunks, *, close=None):
        self.chunks = iter(chunks)
        self.closing = close or getattr(self.chunks, "close", None)

    def __aiter__(self):
        return self._sent()

    async def _sent(self):
        take = sync_to_async(next, thread_sensitive=True)
        while (chunk := await take(self.chunks, None)) is not None:
            yield chunk

    def close(self):
        if self.closing is not None:
            self.closing()


def file_blocks(file, size=2**18):
    """An open binary file's bytes, `size` at a time, sent as read; the file is closed with the response."""
    return SentAsRead(iter(lambda: file.read(size), b""), close=file.close)
