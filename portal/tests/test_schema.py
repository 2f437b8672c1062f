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


@pytest.mark.django_db
def test_anyone_may_read_the_schema_and_it_is_made_once_per_process_not_per_request(monkeypatch):
    """Making and rendering the schema takes a fifth of a second of the web process's CPU, and a stranger
    may ask for it: made per request, a few asking in a loop would take the process from every tenant."""
    from django.test import Client
    made = []
    real = SchemaGenerator.get_schema
    monkeypatch.setattr(SchemaGenerator, "get_schema", lambda self, **kw: made.append(1) or real(self, **kw))
    stranger = Client(HTTP_HOST="127.0.0.1")
    first_yaml, first_json = stranger.get("/api/schema/"), stranger.get("/api/schema/?format=json")
    made.clear()
    again = [stranger.get("/api/schema/"), stranger.get("/api/schema/", {"version": "x1"}),
             stranger.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi; q=0.9"),
             stranger.get("/api/schema/?format=json"), stranger.get("/api/schema/", {"format": "json", "version": "x2"})]
    assert made == []
    assert [r.status_code for r in again] == [200] * 5
    assert again[0].content == first_yaml.content and again[0]["Content-Type"] == first_yaml["Content-Type"]
    assert again[3].json() == first_json.json() and again[3]["Content-Type"] == first_json["Content-Type"]
    assert first_json.json()["info"]["title"] == "Trainyard API" and "Content-Disposition" in again[0]
