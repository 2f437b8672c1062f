"""Reading what a request carries with bounds: query parameters as numbers in a range, limit/offset pages,
JSON bodies. Nothing unbounded reaches the database (which answers numbers beyond 64 bits with a 500) or
Python's stack (a RecursionError). Only DRF's parsers and paginators are imported here: DRF's settings load
this module while `rest_framework.views` is itself still loading."""
import re

from rest_framework.exceptions import ParseError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.parsers import JSONParser


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
    """JSON bodies whose nesting is too deep for Python's decoder are a 400, not a RecursionError (500)."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the body nests too deeply") from None
