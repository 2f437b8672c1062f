"""ASGI entry point: HTTP through Django, websockets through Channels (served by uvicorn)."""
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()  # sets Django up before the imports below load models

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.sessions import SessionMiddlewareStack  # noqa: E402

from jobs.routing import websocket_urlpatterns  # noqa: E402
from jobs.serving import ServingLoop  # noqa: E402
from portal import statement_timeout  # noqa: E402
from portal.bodylimit import BodyLimit, refuse  # noqa: E402
from portal.hosts import WebsocketOriginValidator  # noqa: E402
from portal.overrides.ingest import PATH as INGEST_PATH, IngestRoute  # noqa: E402

statement_timeout.limit()  # the servers' statements only: workers and the scheduling loop bound their own

# The session's cookie only, no AuthMiddleware: the consumers authenticate afresh from the session key
# or token at every check (jobs.consumers), and AuthMiddleware loaded a user nobody read, for every
# socket opening, in the one thread channels gives synchronous code by default.
# ServingLoop: a request's live updates are handed to the server's event loop (jobs.live).
# Agents' posts go straight to their view, past the middleware a browser's request needs.
# BodyLimit: no request's body is read past its route's bound, or for longer than REQUEST_READ_S.
ingest_route = IngestRoute(django_asgi_app)
application = ServingLoop(ProtocolTypeRouter({
    "http": BodyLimit(ingest_route),
    "websocket": WebsocketOriginValidator(SessionMiddlewareStack(URLRouter(websocket_urlpatterns))),
}))


class IngestOnly:
    """ASGI: an agent's post to the ingest endpoint goes to `route`; any other request is answered 404
    and any websocket refused, unread. Learner pods can reach the servers that run this (their network
    policy, jobs.backends.k8s.objects), so nothing else of the platform is served there."""

    def __init__(self, route):
        self.route = route

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and INGEST_PATH.fullmatch(scope.get("path", "")):
            return await self.route(scope, receive, send)
        if scope["type"] == "http":
            return await refuse(send, 404, "this server takes learner agents' posts to /api/v1/ingest/<job id>/ only")
        if scope["type"] == "websocket":
            await receive()  # websocket.connect; closing before accepting refuses the handshake (403)
            await send({"type": "websocket.close", "code": 1008})


# The ingest servers' application (deploy/kubernetes/base/53-ingest.yaml): the same bounds and route
# as the web servers' posts get, and nothing else.
ingest_application = ServingLoop(BodyLimit(IngestOnly(ingest_route)))
