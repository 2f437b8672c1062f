"""The web servers' database statements end at `TRAINYARD_WEB_STATEMENT_TIMEOUT_S`.

A request whose query runs, or waits on a lock, past it is cancelled by PostgreSQL and answered 503
with a Retry-After, so one slow request (a tenant's data grown huge, a table a migration holds) takes
a web thread and a server connection for that long at the most, not for as long as it lasts. Only the
servers' entry point (portal.asgi) calls `limit()`: workers, beat and the scheduling loop bound their
own passes in chunks, and a cancelled pass there would only be tried again from the start.
"""
from django.conf import settings
from django.db import OperationalError
from django.db.backends.signals import connection_created
from django.http import HttpResponse, JsonResponse

QUERY_CANCELED = "57014"  # PostgreSQL's SQLSTATE for a statement cancelled, by statement_timeout here
RETRY_AFTER_S = 10


def limit():
    """Limit every connection this process opens from now on (SQLite has no such limit)."""
    connection_created.connect(_set_timeout, dispatch_uid=__name__)


def _set_timeout(sender, connection, **kwargs):
    if connection.vendor == "postgresql" and settings.WEB_STATEMENT_TIMEOUT_S:
        with connection.cursor() as cursor:
            cursor.execute("SET statement_timeout = %s", [round(settings.WEB_STATEMENT_TIMEOUT_S * 1000)])


def cancelled(exc):
    """Whether `exc` is a statement PostgreSQL cancelled."""
    return isinstance(exc, OperationalError) and getattr(exc.__cause__, "pgcode", None) == QUERY_CANCELED


class StatementTimeoutMiddleware:
    """A request whose statement was cancelled gets a 503 saying so (JSON with `detail` under /api/)
    instead of a 500: nothing is wrong with the request, the database did not answer it in time."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exc):
        if not cancelled(exc):
            return None
        detail = (f"the database did not answer this request within {settings.WEB_STATEMENT_TIMEOUT_S:g} s; "
                  "try again later, or ask for less at once")
        if request.path.startswith("/api/"):
            response = JsonResponse({"detail": detail}, status=503)
        else:
            response = HttpResponse(detail, status=503, content_type="text/plain; charset=utf-8")
        response["Retry-After"] = str(RETRY_AFTER_S)
        return response
