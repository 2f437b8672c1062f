"""Requests served by the platform's own ASGI application (portal.asgi), as uvicorn serves them.

Django's test clients call the views without the ASGI handler's way of sending a response, so how a
streamed answer leaves the process (chunk by chunk, or all read first) shows only here. The
database must be one the handler's threads see: use these in `django_db(transaction=True)` tests.
"""
import asyncio

from asgiref.sync import async_to_sync


def serve_get(path, *, headers=(), query="", on_body=None):
    """GET `path` through portal.asgi.application: (status, body bytes). `on_body(chunk)` is called as
    each chunk of the body is sent, before the next is made."""
    from portal.asgi import application

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(b"host", b"testserver"), *headers], "client": ("127.0.0.1", 5000),
             "server": ("testserver", 80)}
    status, body, asked = [], [], []

    async def receive():
        if not asked:
            asked.append(True)
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # the client stays until the answer is sent

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body" and message.get("body"):
            if on_body is not None:
                on_body(message["body"])
            body.append(message["body"])

    asyncio.run(application(scope, receive, send))
    return status[0], b"".join(body)


def streamed(response):
    """A streamed answer's bytes, as a test client returned it: read the way the ASGI handler reads it
    (asynchronously, jobs.serving.SentAsRead), in the calling thread."""
    async def read():
        return b"".join([chunk async for chunk in response])
    return async_to_sync(read)()
