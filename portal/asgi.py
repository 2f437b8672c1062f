"""ASGI entry point: HTTP through Django, websockets through Channels (served by daphne)."""
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from jobs.routing import websocket_urlpatterns  # noqa: E402
from portal.hosts import WebsocketOriginValidator  # noqa: E402

application = ProtocolTypeRouter({
    "http": django_asgi_app,
    "websocket": WebsocketOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
})
