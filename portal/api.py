"""API-wide plumbing: errors always come back as JSON with a `detail` (and a `field` when one is
to blame), never as an HTML page or a traceback."""
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from jobs.actions import SubmitError
from jobs.states import InvalidTransition
from tenants.access import NoTenant


def exception_handler(exc, context):
    if isinstance(exc, SubmitError):
        body = {"detail": exc.detail}
        if exc.field:
            body["field"] = exc.field
        return Response(body, status=exc.status)
    if isinstance(exc, InvalidTransition):
        return Response({"detail": str(exc)}, status=409)
    if isinstance(exc, NoTenant):
        return Response({"detail": str(exc)}, status=403)
    return drf_exception_handler(exc, context)
