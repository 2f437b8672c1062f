"""Django's ASGI handler with the middleware and the view of a request run in one thread, in one go.

Django's own ASGI handler builds an async middleware chain; sync-only middleware in it (WhiteNoise,
the audit actor, the CSP) makes it hop from the event loop to a thread, back to the loop for the
async middleware inside and the handler, and to the thread again for the (synchronous) view: six
crossings a request, each waiting for the loop or for the thread to get a core. Under load those
waits were a quarter of a submission's time (bench controlplane, py-spy: Condition.wait in
asgiref's CurrentThreadExecutor). Every view and middleware here is synchronous, so this handler
loads the chain as WSGI does and runs it in the request's thread: two crossings. The rest (reading
the body, the request signals, a client's disconnect, sending the response) is Django's, unchanged.
"""
from asgiref.sync import sync_to_async
from django.core.handlers import base
from django.core.handlers.asgi import ASGIHandler
from django.http import FileResponse


class ThreadedASGIHandler(ASGIHandler):
    def __init__(self):
        base.BaseHandler.__init__(self)
        self.load_middleware(is_async=False)

    async def run_get_response(self, request):
        # thread_sensitive: the request's own thread (ASGIHandler opens a ThreadSensitiveContext per
        # request), as Django runs a synchronous view.
        response = await sync_to_async(self.get_response, thread_sensitive=True)(request)
        response._handler_class = self.__class__
        if isinstance(response, FileResponse):  # as ASGIHandler: the server chunks it
            response.block_size = self.chunk_size
        return response
