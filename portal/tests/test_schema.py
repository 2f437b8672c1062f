"""The OpenAPI schema served at /api/schema/: drf-spectacular generates it without a warning (a view it
cannot read is left undescribed, with only a warning to say so), and every answer of every operation
has a type. tests/security/test_api_fuzz.py checks the API's answers against it."""
import pytest
from django.core.management import call_command
from drf_spectacular.drainage import GENERATOR_STATS
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.management.commands.spectacular import SchemaGenerationError

# The Error component: what every error answer holds (portal.schema).
ERROR = {"$ref": "#/components/schemas/Error"}


@pytest.fixture(scope="module")
def operations():
    schema = SchemaGenerator().get_schema(request=None, public=True)
    return {f"{method.upper()} {path}": operation for path, methods in schema["paths"].items()
            for method, operation in methods.items()}


def test_it_generates_the_schema_without_a_warning(tmp_path, capsys):
    GENERATOR_STATS.reset()  # warnings of an earlier generation in this process are remembered, and not repeated
    try:
        call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yml"))
    except SchemaGenerationError:
        pytest.fail(capsys.readouterr().err)


def test_it_types_every_answer_of_every_operation(operations):
    assert len(operations) >= 40
    untyped = []
    for label, operation in operations.items():
        for status, response in operation["responses"].items():
            if status == "204":
                assert "content" not in response, label
                continue
            content = response.get("content") or {}
            if not content or not all(media.get("schema") for media in content.values()):
                untyped.append(f"{label} {status}")
    assert not untyped, untyped


def test_every_operation_has_a_success_and_its_errors_are_the_error_body(operations):
    for label, operation in operations.items():
        statuses = operation["responses"]
        assert any(status.startswith("2") for status in statuses), label
        for status in ("401", "403", "404", "429"):
            assert statuses[status]["content"]["application/json"]["schema"] == ERROR, (label, status)
