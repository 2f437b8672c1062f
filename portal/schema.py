"""The OpenAPI schema's additions to drf-spectacular's: the error answers every operation can give.
Added by a postprocessing hook (SPECTACULAR_SETTINGS), drf-spectacular's documented place for changes to
the whole schema, after every view's own answers are in."""

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
