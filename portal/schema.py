"""The OpenAPI schema's additions to drf-spectacular's: the error answers every operation can give.
Added by a postprocessing hook (SPECTACULAR_SETTINGS), drf-spectacular's documented place for changes to
the whole schema, after every view's own answers are in. And the view that serves it, made once per
process (`SchemaView`)."""
import threading
from typing import ClassVar

from django.conf import settings
from django.http import HttpResponse
from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SpectacularAPIView

# Answers any endpoint may give, whatever it does: checked by tests/security/test_api_fuzz.py.
ERROR_RESPONSES = {
    "400": "A parameter or body field is not what the endpoint reads (`field` names it)",
    "401": "No valid credentials (an API token: `Authorization: Token <key>`)",
    "403": "Not allowed in this tenant (or the caller belongs to no tenant)",
    "404": "No such object in the caller's tenant (another tenant's objects answer the same)",
    "429": "Too many requests; retry after the Retry-After header's seconds",
}
UNSUPPORTED_BODY = "The body's content type is not one the endpoint reads, or the body is not that type"
WITH_A_BODY = ("post", "put", "patch")

# jobs.serializers.ErrorSerializer, which the views' own error answers name.
ERROR = {"$ref": "#/components/schemas/Error"}


def add_error_responses(result, generator, request, public):
    """Give every operation the error answers it does not describe itself, as the Error component, so
    clients (and the fuzzer) know them."""
    if "Error" not in result.get("components", {}).get("schemas", {}):
        raise LookupError("the schema has no Error component: no view names jobs.serializers.ErrorSerializer")
    for methods in result["paths"].values():
        for method, operation in methods.items():
            errors = dict(ERROR_RESPONSES, **({"415": UNSUPPORTED_BODY} if method in WITH_A_BODY else {}))
            responses = operation.setdefault("responses", {})
            for status, description in errors.items():
                responses.setdefault(status, {"content": {"application/json": {"schema": ERROR}},
                                              "description": description})
    return result


class SchemaView(SpectacularAPIView):
    """drf-spectacular's schema view, the schema made and rendered once per process and format: it is the
    same for every caller, anyone may ask for it, and making it takes a fifth of a second of the web
    process's CPU, so a few strangers asking in a loop would take the process from every tenant. A
    `?version=` is not read (the API has one version): each value would have made a schema of its own."""

    made: ClassVar[dict] = {}  # renderer class -> (content, content type)
    making = threading.Lock()

    @extend_schema(exclude=True)  # as drf-spectacular's own get (SERVE_INCLUDE_SCHEMA off)
    def get(self, request, *args, **kwargs):
        renderer = request.accepted_renderer
        with self.making:  # callers arriving at once wait for the one making it, rather than each making it
            if type(renderer) not in self.made:
                self.made[type(renderer)] = self._made(renderer)
        content, content_type = self.made[type(renderer)]
        response = HttpResponse(content, content_type=content_type)
        response["Content-Disposition"] = f'inline; filename="{settings.SPECTACULAR_SETTINGS["TITLE"]}.{renderer.format}"'
        return response

    def _made(self, renderer):
        schema = self.generator_class(urlconf=self.urlconf, patterns=self.patterns).get_schema(
            request=None, public=self.serve_public)
        content = renderer.render(schema, renderer.media_type, self.get_renderer_context())
        return content, f"{renderer.media_type}; charset={renderer.charset}" if renderer.charset else renderer.media_type
