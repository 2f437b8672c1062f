"""API-wide plumbing: errors always come back as JSON with a `detail` (and a `field` when one is
to blame), never as an HTML page or a traceback. Bounded reading of parameters and bodies: jobs.bounds."""
from django.http import JsonResponse
from django.views import defaults
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from jobs.deletion import AlreadyDeleted
from jobs.submission import SubmitError
from jobs.states import InvalidTransition
from jobs.bounds import BadParameter
from tenants.access import NoTenant
from tenants.throttling import Busy


def exception_handler(exc, context):
    if isinstance(exc, BadParameter):
        return Response({"detail": str(exc), "field": exc.field}, status=400)
    if isinstance(exc, SubmitError):
        body = {"detail": exc.detail}
        if exc.field:
            body["field"] = exc.field
        return Response(body, status=exc.status, headers=exc.headers())
    if isinstance(exc, AlreadyDeleted):  # deleted by another request since this one found it: gone
        return Response({"detail": str(exc)}, status=404)
    if isinstance(exc, InvalidTransition):
        return Response({"detail": str(exc)}, status=409)
    if isinstance(exc, Busy):  # a tenant's heavy requests at once (tenants.throttling.held)
        return Response({"detail": str(exc)}, status=429, headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, NoTenant):
        return Response({"detail": str(exc)}, status=403)
    return drf_exception_handler(exc, context)


def not_found(request, exception=None):
    """Django's 404 (a URL that matches no route, e.g. /api/v1/tokens/abc/): JSON under /api/, like every
    other API answer; the usual page elsewhere."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": "No such endpoint or object."}, status=404)
    return defaults.page_not_found(request, exception)
