"""Reading what a request carries with bounds: query parameters as numbers in a range, limit/offset pages,
JSON bodies, and no NUL character anywhere. Nothing unbounded reaches the database (which answers numbers
beyond 64 bits with a 500, and text holding NUL with another) or Python's stack (a RecursionError). Only
DRF's parsers and paginators are imported here: DRF's settings load this module while `rest_framework.views`
is itself still loading."""
import re
from datetime import datetime

from django.http import HttpResponseBadRequest, JsonResponse

from rest_framework.exceptions import ParseError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser


class BadParameter(ValueError):
    """A query parameter that is not what the endpoint reads: 400 {detail, field}."""

    def __init__(self, field_name, rule):
        self.field = field_name
        super().__init__(f"{field_name}: {rule}")


def whole_number(params, name, *, default, minimum, maximum):
    """The query parameter `name` as an int in minimum..maximum (`default` when absent), or BadParameter.
    Bounded because a database refuses (with a 500) numbers beyond 64 bits in LIMIT or a comparison."""
    text = params.get(name)
    if text is None or text == "":
        return default
    digits = re.fullmatch(r"\s*\+?([0-9]{1,19})\s*", text)  # ASCII only: str.isdigit() takes "²", int() refuses it
    if digits is None or not minimum <= int(digits.group(1)) <= maximum:
        raise BadParameter(name, f"must be a whole number in {minimum}..{maximum}")
    return int(digits.group(1))


def moment(params, name):
    """The query parameter `name` as an aware datetime (ISO 8601 with its offset, or Z), None when
    absent, or BadParameter."""
    text = params.get(name)
    if text is None or text == "":
        return None
    try:
        value = datetime.fromisoformat(text.strip()) if len(text) <= 40 else None
    except ValueError:
        value = None
    if value is None or value.tzinfo is None:
        raise BadParameter(name, "must be an ISO 8601 time with its offset (2026-11-30T12:00:00Z)")
    return value


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    """limit/offset pages whose parameters are checked (400 naming the parameter) instead of silently
    replaced by defaults, or passed to the database however large (a 500)."""

    max_limit = 200
    max_offset = 10**9

    def get_limit(self, request):
        return whole_number(request.query_params, self.limit_query_param, default=self.default_limit, minimum=1,
                            maximum=self.max_limit)

    def get_offset(self, request):
        return whole_number(request.query_params, self.offset_query_param, default=0, minimum=0,
                            maximum=self.max_offset)

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        bounds = {self.limit_query_param: (1, self.max_limit), self.offset_query_param: (0, self.max_offset)}
        for parameter in parameters:
            low, high = bounds[parameter["name"]]
            parameter["schema"].update(minimum=low, maximum=high)
        return parameters


class BoundedJSONParser(JSONParser):
    """JSON bodies whose nesting is too deep for Python's decoder are a 400, not a RecursionError (500);
    so is a NUL character in any of its texts, which PostgreSQL stores in no text or JSON column."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the body nests too deeply") from None
        if (where := _nul_in(data, "")) is not None:  # a 400 {detail, field} like a bad parameter's
            raise BadParameter(_shown(where) or "body", "holds a NUL character")
        return data


class _NoNulFields:
    """A form's fields (not its files' contents) holding a NUL character are a 400 {detail, field}."""

    def parse(self, stream, media_type=None, parser_context=None):
        parsed = super().parse(stream, media_type, parser_context)
        if (name := _nul_field(getattr(parsed, "data", parsed))) is not None:  # multipart: data and files
            raise BadParameter(_shown(name), "holds a NUL character")
        return parsed


class BoundedFormParser(_NoNulFields, FormParser):
    """DRF's url-encoded form parser, refusing NUL in a field like BoundedJSONParser."""


class BoundedMultiPartParser(_NoNulFields, MultiPartParser):
    """DRF's multipart parser, refusing NUL in a field (files are read by their own rules)."""


def _nul_in(data, path):
    """The dotted path of the first key or text in parsed JSON that holds a NUL character, or None.
    A stack, not recursion: the body may nest as deep as the decoder went."""
    stack = [(path, data)]
    while stack:
        at, value = stack.pop()
        if isinstance(value, str) and "\x00" in value:
            return at
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            inner = f"{at}.{key}" if at else str(key)
            if isinstance(key, str) and "\x00" in key:
                return inner
            stack.append((inner, item))
    return None


def _shown(name):
    """A name that may hold NUL, as an answer can say it."""
    return name.replace("\x00", "\\0")


def _nul_field(query):
    return next((name for name, values in query.lists() if "\x00" in name or any("\x00" in v for v in values)), None)


class NulRefusalMiddleware:
    """A path, query parameter or form field holding a NUL character is a 400 naming it, before any
    view: every filter, cursor, id and form value would otherwise reach the database as text it
    refuses (a 500). API answers are JSON with `detail` and `field`, like every other error of the
    API. Only url-encoded forms are read here: a multipart body is left to its view, whose upload
    handlers bound what it reads (BoundedJSONParser checks JSON bodies)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        field = "path" if "\x00" in request.path else _nul_field(request.GET)
        if field is None and request.method == "POST" and request.content_type == "application/x-www-form-urlencoded":
            field = _nul_field(request.POST)
        if field is None:
            return self.get_response(request)
        field = _shown(field)
        detail = f"{field}: holds a NUL character"
        if request.path.startswith("/api/"):
            return JsonResponse({"detail": detail, "field": field}, status=400)
        return HttpResponseBadRequest(detail, content_type="text/plain; charset=utf-8")
