"""Schemathesis against the API as drf-spectacular describes it at /api/schema/.

In-process (Django's WSGI application, the pytest-django test database; no ports, no servers), as an
authenticated researcher of tenant team-a who owns a real job with something in every list (log lines,
metric points, events, an allocation, a stored file, a share) and an invitation, webhook and delivery
of their own: path parameters are those objects for most generated cases, so the fuzzer reaches the
code that answers with them rather than only 404s. Each operation gets positive and negative cases;
every response must not be a 5xx, must have a status code and content type the schema documents, and a
body its schema accepts. The schema is checked closed: every object it describes is taken to have no
keys besides those it lists, so a key an answer carries that the schema does not name fails too.

Every operation must answer at least one case with a 2xx and its body: the researcher cannot do what
only admins do, so those operations get a second, shorter run as carol, admin of team-a, and the quota's
as root, a platform admin. At least MIN_CASES cases run in all (checked at the end).

What cannot end the run: the researcher's token is not theirs to lose (token ids map onto a separate
sacrificial token of theirs, never the one authenticating the run); they are not a tenant admin, so they
cannot remove themselves; halting or terminating the job is fine (later cases see a final job); DELETEs
run after every other operation, so the objects they remove were there for the rest.
"""
import hashlib
import time

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from django.db import connections
from django.test import Client
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core.failures import FailureGroup
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from jobs import experiments, sharing, storage
from jobs.models import Allocation, Artifact, JobEvent, LogLine, MetricPoint, Status
from notifications.models import Delivery, Webhook
from tenants import quotas
from tenants.models import ApiToken, Invitation
from tests.support.builders import MANIFEST, job, member, tar_gz, upload

pytestmark = pytest.mark.django_db

EXPERIMENT = MANIFEST + b"""hyperparameters: {lr: {type: log, minval: 0.001, maxval: 0.1}}
searcher: {name: random, metric: loss, smaller_is_better: true, max_trials: 4, max_concurrent_trials: 2}
"""
MIN_CASES = 1000
CASES_PER_OPERATION = 30  # per generation mode (positive, negative), over ~40 operations
ADMIN_CASES = 10  # per admin-only operation, positive cases only
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
# What a researcher is refused (403) whatever they send, and who gets the run that reaches it.
ADMIN_ONLY = {
    "POST /api/v1/tenants/current/members/": "carol", "PATCH /api/v1/tenants/current/members/{username}/": "carol",
    "DELETE /api/v1/tenants/current/members/{username}/": "carol",
    "GET /api/v1/tenants/current/invitations/": "carol",
    "DELETE /api/v1/tenants/current/invitations/{invitation_id}/": "carol",
    "PUT /api/v1/tenants/{slug}/quota/": "root", "PATCH /api/v1/tenants/{slug}/quota/": "root",
    "PUT /api/v1/tenants/current/idle-gpus/": "carol", "DELETE /api/v1/tenants/current/idle-gpus/": "carol",
}


@pytest.fixture
def connection_kept(monkeypatch):
    """Keep the test's database connection across requests: the WSGI handler's close_old_connections
    would close it at each request's start and end (inside the test's transaction it is not in
    autocommit, which the handler takes for a broken connection; on PostgreSQL every later request
    then fails with "connection already closed"). Disconnecting the handler's receivers is not
    enough: Django's test client, which the set-up uses, connects them again after each request."""
    for alias in connections:
        monkeypatch.setattr(connections[alias], "close_if_unusable_or_obsolete", lambda: None)
    yield


def closed(node):
    """The schema with every object that lists its properties closed to others (in place)."""
    if isinstance(node, dict):
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for value in node.values():
            closed(value)
    elif isinstance(node, list):
        for value in node:
            closed(value)
    return node


def seeded(researcher, colleague):
    """The researcher's job with something in each of its lists, and their own objects: {parameter: [values]}."""
    now = timezone.now()
    target = job(researcher, name="fuzz-target", placement=[{"node": "local", "gpu_ids": []}])
    # Active and placed, so the cluster's my_jobs lists it (the cluster is fuzzed before it is halted).
    running = job(researcher, name="fuzz-running", status=Status.PROCESSING,
                  placement=[{"node": "local", "gpu_ids": [0]}])
    halted = job(researcher, name="fuzz-halted", status=Status.HALTED)
    ended = job(researcher, name="fuzz-ended", status=Status.COMPLETED)  # deleting it leaves the others
    JobEvent.objects.create(job=target, from_status="", to_status=Status.QUEUED, actor="alice", reason="submitted")
    for seq, (stream, line) in enumerate([("stdout", "epoch 1 loss 0.5"), ("stderr", ""), ("system", "stored")], 1):
        LogLine.objects.create(job=target, seq=seq, stream=stream, time=now, line=line)
    MetricPoint.objects.create(job=target, name="loss", step=1, value=0.5, time=now)
    MetricPoint.objects.create(job=target, name="accuracy", step=None, value=0.9, time=now)
    Allocation.objects.create(job=target, attempt=1, learners=1, reason="submitted", started_at=now)
    content = b"weights"
    path = storage.job_dir(target.tenant.slug, target.id) / "results" / "model.txt"
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    Artifact.objects.create(job=target, kind=Artifact.Kind.RESULT, name="results/model.txt", size=len(content),
                            sha256=hashlib.sha256(content).hexdigest())
    sharing.share(target, colleague.user.username, "view")
    invitation, declined = (Invitation.objects.create(tenant=member(slug, "dave", role="admin").tenant,
                                                      username="alice", role="viewer", invited_by="dave")
                            for slug in ("team-b", "team-c"))
    waiting = Invitation.objects.create(tenant=researcher.tenant, username="erin", invited_by="carol")
    hook = Webhook.objects.create(tenant=researcher.tenant, user=researcher.user, url="https://hooks.example/t",
                                  sealed_secret="x", created_by="alice")
    Delivery.objects.create(webhook=hook, job=target, event="completed", payload={}, tries=1, response_status=500,
                            last_error="HTTP 500")
    sweep, to_pause, paused, to_kill, finished = (
        experiments.create(researcher, manifest_bytes=EXPERIMENT, code_file=upload(tar_gz({"run.sh": b"echo hi\n"})))
        for _ in range(5))
    experiments.kill(finished, actor="alice")  # no trial started yet: it finishes at once, so it can be deleted
    experiments.advance(sweep.id)  # its first trials, as jobs
    MetricPoint.objects.create(job=sweep.trials.first().job, name="loss", step=1, value=0.5, time=now)
    experiments.pause(paused, actor="alice")
    real = {"job_id": [target.id], "name": ["results/model.txt"], "username": [colleague.user.username],
            "slug": ["team-a"], "invitation_id": [invitation.pk, waiting.pk], "hook_id": [hook.pk],
            "experiment_id": [sweep.id]}
    # Operations that need an object of their own, in a state where they can succeed.
    per_operation = {"POST /api/v1/jobs/{job_id}/halt/": {"job_id": [running.id]},
                     "POST /api/v1/jobs/{job_id}/resume/": {"job_id": [halted.id]},
                     "DELETE /api/v1/jobs/{job_id}/": {"job_id": [ended.id]},
                     "POST /api/v1/invitations/{invitation_id}/decline/": {"invitation_id": [declined.pk]},
                     "POST /api/v1/experiments/{experiment_id}/pause/": {"experiment_id": [to_pause.id]},
                     "POST /api/v1/experiments/{experiment_id}/resume/": {"experiment_id": [paused.id]},
                     "POST /api/v1/experiments/{experiment_id}/kill/": {"experiment_id": [to_kill.id]},
                     "DELETE /api/v1/experiments/{experiment_id}/": {"experiment_id": [finished.id]}}
    return real, per_operation, f"{target.id},{running.id}"


# Path segments routed before a parameter in their place (/api/v1/jobs/compare/ before
# /api/v1/jobs/{job_id}/): a generated id spelling one reaches that other operation, not this one.
ROUTED_SEGMENTS = {"compare"}


def _unrouted(value):
    """[value], unless it spells a segment of another route."""
    return [] if value in ROUTED_SEGMENTS else [value]


@pytest.fixture
def api(settings, connection_kept):
    """The schema as served, closed, with hooks that put the seeded objects into path parameters and, now
    and then, a valid manifest and code into bodies (most of the time: Hypothesis also keeps the
    generated value). Returns (schema, {username: headers})."""
    settings.ALLOWED_HOSTS = ["*"]
    researcher = member("team-a", "alice")
    # The intake's limits are jobs/tests/test_intake's to check. Here the two creating operations, jobs
    # and experiments, would spend the tenant's burst of submissions between them and leave one only 429s.
    quotas.set_quota(researcher.tenant, submissions_per_minute=100_000)
    colleague = member("team-a", "bob")
    root = member("team-a", "root", role="admin")
    root.user.is_superuser = True
    root.user.save()
    headers = {m.user.username: {"Authorization": f"Token {ApiToken.issue(m.user)[1]}"}
               for m in (researcher, member("team-a", "carol", role="admin"), root)}
    sacrificial, _ = ApiToken.issue(researcher.user)
    real, per_operation, compared = seeded(researcher, colleague)
    real["token_id"] = [sacrificial.pk]
    raw = Client().get("/api/schema/?format=json").json()
    schema = schemathesis.openapi.from_dict(closed(raw))
    schema.app, schema.location = get_wsgi_application(), "/api/schema/?format=json"
    bodies = {"POST /api/v1/jobs/": {"manifest": MANIFEST, "code": tar_gz({"run.sh": b"echo hi\n"})},
              "POST /api/v1/experiments/": {"manifest": EXPERIMENT, "code": tar_gz({"run.sh": b"echo hi\n"})},
              "POST /api/v1/manifests/validate/": {"manifest": MANIFEST.decode()},
              "POST /api/v1/jobs/{job_id}/share/": {"username": "bob", "access": "control"},
              "POST /api/v1/webhooks/": {"url": "https://1.1.1.1/hook", "events": ["completed"]},
              "PUT /api/v1/account/default-tenant/": {"tenant": "team-a"}}
    queries = {"GET /api/v1/jobs/compare/": {"ids": compared}}

    @schema.hook
    def flatmap_path_parameters(context, path_parameters):
        if not path_parameters:
            return st.just(path_parameters)
        known = real | per_operation.get(context.operation.label, {})
        return st.fixed_dictionaries({
            name: st.sampled_from([*known[name], *known[name], *_unrouted(value)]) if name in known else st.just(value)
            for name, value in path_parameters.items()})

    @schema.hook
    def flatmap_body(context, body):
        valid = bodies.get(context.operation.label)
        return st.sampled_from([valid, body]) if valid is not None and isinstance(body, dict) else st.just(body)

    @schema.hook
    def flatmap_query(context, query):
        valid = queries.get(context.operation.label)
        return st.sampled_from([valid, query]) if valid is not None else st.just(query)

    return schema, headers


def test_the_api_never_errs_and_answers_as_documented(api):
    schema, headers = api
    started, cases, failures, answered = time.monotonic(), 0, {}, {}
    operations = sorted((result.ok() for result in schema.get_all_operations()), key=lambda op: op.method == "delete")
    assert len(operations) >= 40, [op.label for op in operations]

    def fuzz(operation, mode, as_whom, examples):
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(mode, hooks=schema.hooks, headers=as_whom))
        def run(case):
            nonlocal cases
            cases += 1
            response = case.call()
            answered.setdefault(operation.label, set()).add(response.status_code)
            try:
                case.validate_response(response, checks=CHECKS)
            except FailureGroup as exc:  # recorded, and the run goes on to find every distinct failure
                failures.setdefault((operation.label, _summary(exc)), f"{operation.label} ({mode.value}): {exc}")

        try:
            run()
        except Unsatisfiable:  # nothing to negate: an operation without parameters or body
            assert mode == GenerationMode.NEGATIVE, operation.label

    for operation in operations:
        for mode in MODES:
            fuzz(operation, mode, headers["alice"], CASES_PER_OPERATION)
    for operation in operations:
        if operation.label in ADMIN_ONLY:
            fuzz(operation, GenerationMode.POSITIVE, headers[ADMIN_ONLY[operation.label]], ADMIN_CASES)
    elapsed = time.monotonic() - started
    print(f"\nschemathesis: {cases} cases over {len(operations)} operations in {elapsed:.0f}s")
    assert not failures, f"{len(failures)} distinct failures:\n\n" + "\n\n".join(list(failures.values())[:30])
    never_succeeded = sorted(op.label for op in operations if not any(200 <= s < 300 for s in answered[op.label]))
    assert not never_succeeded, "\n".join(f"{label}: {sorted(answered[label])}" for label in never_succeeded)
    assert cases >= MIN_CASES


def _summary(exc):
    """What makes two failures the same: the operation's response status and the checks' titles."""
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(("- ", "[", "Received"))]
    return " | ".join(lines[:4]) or text[:200]
