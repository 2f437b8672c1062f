"""The OpenAPI schema's additions to drf-spectacular's: the error answers every operation can give.
Loaded lazily by DRF (DEFAULT_SCHEMA_CLASS), after the views exist."""
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiResponse

from jobs.serializers import ErrorSerializer

# Answers any endpoint may give, whatever it does: checked by tests/security/test_api_fuzz.py.
ERROR_RESPONSES = {
    "400": "A parameter or body field is not what the endpoint reads (`field` names it)",
    "401": "No valid credentials (an API token: `Authorization: Token <key>`)",
    "403": "Not allowed in this tenant (or the caller belongs to no tenant)",
    "404": "No such object in the caller's tenant (another tenant's objects answer the same)",
    "429": "Too many requests; retry after the Retry-After header's seconds",
}


class ApiSchema(AutoSchema):
    """drf-spectacular's schema, with the error answers every operation can give documented as the JSON
    they are (the Error component), so clients (and the fuzzer) know them."""

    def _get_response_bodies(self, direction="response"):
        responses = super()._get_response_bodies(direction)
        if direction == "response":
            errors = dict(ERROR_RESPONSES)
            if self.method in ("POST", "PUT", "PATCH"):
                errors["415"] = "The body's content type is not one the endpoint reads, or the body is not that type"
            for status, description in errors.items():
                if status not in responses:
                    responses[status] = self._get_response_for_code(
                        OpenApiResponse(ErrorSerializer, description=description), status, direction=direction)
        return responses
