"""Which event loop of the ASGI server the running code serves, if any: a request's thread hands its
live updates to that loop (jobs.live) instead of waiting for them to leave.

The server's application is wrapped in ServingLoop (portal.asgi), which records the loop in a context
variable; asgiref carries context variables into the threads that run a request's synchronous code,
so a view, a consumer's database call or an ingest post sees it, and a Celery worker or a management
command does not.
"""
import asyncio
from contextvars import ContextVar

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
