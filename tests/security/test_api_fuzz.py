"""Schemathesis against the API as drf-spectacular describes it at /api/schema/ (issue 12, finding 9).

In-process (Django's WSGI application, the pytest-django test database; no ports, no servers), as an
authenticated researcher of tenant team-a who owns a real job: `{job_id}` path parameters are that job
for most generated cases, so the fuzzer reaches the job's own code paths rather than only 404s. Each
operation gets positive and negative cases; every response must not be a 5xx, must have a status code,
content type and body the schema documents. At least MIN_CASES cases run in all (checked at the end).

What cannot end the run: the researcher's token is not theirs to lose (token ids map onto a separate
sacrificial token of theirs, never the one authenticating the run); they are not a tenant admin, so they
cannot remove themselves; halting or terminating the job is fine (later cases see a final job).
"""
import time

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core.failures import FailureGroup
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from tenants.models import ApiToken
from tests.support.builders import job, member

pytestmark = pytest.mark.django_db

MIN_CASES = 1000
CASES_PER_OPERATION = 30  # per generation mode (positive, negative), over ~25 operations
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]


@pytest.fixture
def connection_kept():
    """Keep the test's database connection across requests, as Django's test client does: the WSGI
    handler would otherwise close it after the first one (it is inside the test's transaction, so on
    PostgreSQL every later request fails with "connection already closed")."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def api(settings, connection_kept):
    """The schema as served, with hooks that put the researcher's real job, colleague, token and tenant
    into path parameters (most of the time: Hypothesis also keeps the generated value)."""
    settings.ALLOWED_HOSTS = ["*"]
    researcher = member("team-a", "alice")
    member("team-a", "bob")
    _, key = ApiToken.issue(researcher.user)
    sacrificial, _ = ApiToken.issue(researcher.user)
    target = job(researcher, name="fuzz-target")
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application())
    real = {"job_id": target.id, "username": "bob", "token_id": sacrificial.pk, "slug": "team-a"}

    @schema.hook
    def flatmap_path_parameters(context, path_parameters):
        if not path_parameters:
            return st.just(path_parameters)
        return st.fixed_dictionaries({
            name: st.sampled_from([real[name], real[name], value]) if name in real else st.just(value)
            for name, value in path_parameters.items()})

    return schema, {"Authorization": f"Token {key}"}


def test_the_api_never_errs_and_answers_as_documented(api):
    schema, headers = api
    started, cases, failures = time.monotonic(), 0, {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20, [op.label for op in operations]
    for operation in operations:
        for mode in MODES:
            @settings(max_examples=CASES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(mode, hooks=schema.hooks, headers=headers))
            def run(case):
                nonlocal cases
                cases += 1
                try:
                    case.call_and_validate(checks=CHECKS)
                except FailureGroup as exc:  # recorded, and the run goes on to find every distinct failure
                    failures.setdefault((operation.label, _summary(exc)), f"{operation.label} ({mode.value}): {exc}")

            try:
                run()
            except Unsatisfiable:  # nothing to negate: an operation without parameters or body
                assert mode == GenerationMode.NEGATIVE, operation.label
    elapsed = time.monotonic() - started
    print(f"\nschemathesis: {cases} cases over {len(operations)} operations in {elapsed:.0f}s")
    assert not failures, f"{len(failures)} distinct failures:\n\n" + "\n\n".join(list(failures.values())[:30])
    assert cases >= MIN_CASES


def _summary(exc):
    """What makes two failures the same: the operation's response status and the checks' titles."""
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(("- ", "[", "Received"))]
    return " | ".join(lines[:4]) or text[:200]
