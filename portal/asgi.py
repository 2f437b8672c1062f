"""ASGI entry point: HTTP through Django, websockets through Channels (served by uvicorn)."""
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()  # sets Django up before the imports below load models

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.sessions import SessionMiddlewareStack  # noqa: E402

from jobs.routing import websocket_urlpatterns  # noqa: E402
from jobs.serving import ServingLoop  # noqa: E402
from portal.bodylimit import BodyLimit  # noqa: E402
from portal.hosts import WebsocketOriginValidator  # noqa: E402
from portal.overrides.ingest import IngestRoute  # noqa: E402

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
