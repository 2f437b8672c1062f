"""ASGI entry point: HTTP through Django, websockets through Channels (served by daphne)."""
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

import django  # noqa: E402

django.setup(set_prefix=False)  # as django.core.asgi.get_asgi_application does

from portal.handler import ThreadedASGIHandler  # noqa: E402

# Django's ASGI handling, with each request's middleware and view run in one thread (portal.handler).
django_asgi_app = ThreadedASGIHandler()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.sessions import SessionMiddlewareStack  # noqa: E402

from jobs.ingest_asgi import IngestRoute  # noqa: E402
from jobs.routing import websocket_urlpatterns  # noqa: E402
from portal.hosts import WebsocketOriginValidator  # noqa: E402

# The session's cookie only, no AuthMiddleware: the consumers authenticate afresh from the session key
# or token at every check (jobs.consumers), and AuthMiddleware loaded a user nobody read, for every
# socket opening, in the one thread channels gives synchronous code by default.
application = ProtocolTypeRouter({
    # Agents' posts go straight to their view, past the middleware a browser's request needs.
    "http": IngestRoute(django_asgi_app),
    "websocket": WebsocketOriginValidator(SessionMiddlewareStack(URLRouter(websocket_urlpatterns))),
})
