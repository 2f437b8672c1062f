"""jobs.serving: the ASGI server's event loop, as the code of a request sees it."""
import asyncio
import contextvars
import threading

from asgiref.sync import sync_to_async

from jobs import serving
from jobs.serving import ServingLoop, serving_loop


def served(function):
    """`function()`'s result, run in a thread as the wrapped ASGI application runs a request's sync code,
    and the loop that served it."""
    async def application(scope, receive, send):
        return await sync_to_async(function, thread_sensitive=False)()

    async def serve():
        return await ServingLoop(application)({"type": "http"}, None, None), asyncio.get_running_loop()
    return asyncio.run(serve())


def test_a_requests_thread_sees_the_loop_that_serves_it():
    seen, loop = served(serving_loop)
    assert seen is loop


def test_code_outside_the_server_sees_none():
    assert serving_loop() is None  # a Celery worker, a management command
    result = []
    thread = threading.Thread(target=lambda: result.append(serving_loop()))
    thread.start()
    thread.join()
    assert result == [None]

    async def unwrapped():  # an event loop that is not the server's
        return await sync_to_async(serving_loop, thread_sensitive=False)()
    assert asyncio.run(unwrapped()) is None


def test_a_loop_that_stopped_is_not_handed_anything():
    """A thread still running after its loop ended (the process stopping) publishes by itself."""
    request_context, loop = served(contextvars.copy_context)
    assert loop.is_closed()
    assert request_context.run(serving_loop) is None
    assert request_context.run(serving._loop.get) is loop  # it was set
