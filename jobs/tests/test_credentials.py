"""Learner credentials (jobs.credentials): random, hashed, one job attempt and one learner each, dead
once the attempt is over, and checked before ingest reads a byte of the body."""
import json

import pytest
from django.test import Client

from jobs import credentials, ingest
from jobs.lifecycle import deploy_spec
from jobs.backends.local import LocalBackend
from jobs.models import Job, LearnerCredential, LogLine
from tests.support.builders import job, member

pytestmark = pytest.mark.django_db

MANIFEST = "name: pair\nlearners: 2\nframework: {name: custom, command: sh run.sh}\n"


@pytest.fixture
def pair():
    """A two-learner job whose attempt 1 is running, with each learner's credential."""
    target = job(member(), status="PROCESSING", learners=2, manifest_yaml=MANIFEST)
    target.tokens = credentials.issue_for_attempt(target)
    return target


def post(target, token, *, attempt=1, learner=0, body=None):
    body = body if body is not None else json.dumps({"attempt": attempt, "learner": learner, "records": [
        {"seq": 1, "kind": "log", "stream": "stdout", "time": 1.0, "line": "hello"}]})
    return Client().post(f"/api/v1/ingest/{target.id}/", body, content_type="application/json",
                         HTTP_AUTHORIZATION=f"Ingest {token}")


def test_it_issues_a_random_credential_per_learner_and_keeps_only_its_digest(pair):
    first, second = pair.tokens
    assert first != second and len(first) >= 43
    rows = {row.learner: row for row in LearnerCredential.objects.filter(job=pair)}
    assert {i: (r.attempt, r.digest) for i, r in rows.items()} == {
        0: (1, credentials.digest(first)), 1: (1, credentials.digest(second))}
    stored = json.dumps(list(LearnerCredential.objects.values()), default=str)
    assert first not in stored and second not in stored


def test_a_learner_posts_as_itself_only(pair):
    assert post(pair, pair.tokens[0], learner=0).status_code == 200
    assert post(pair, pair.tokens[1], learner=1).status_code == 200
    refused = post(pair, pair.tokens[0], learner=1)
    assert refused.status_code == 401 and "learner 0" in refused.json()["detail"]
    assert LogLine.objects.filter(learner=1).count() == 1


def test_a_credential_is_good_for_its_own_job_and_attempt_only(pair):
    other = job(member("team-b", "bob"), status="PROCESSING", manifest_yaml=MANIFEST)
    assert post(pair, credentials.issue_for_attempt(other)[0]).status_code == 401
    assert post(pair, pair.tokens[0], attempt=2).status_code == 401
    Job.objects.filter(pk=pair.pk).update(attempt=2)
    fresh = credentials.issue_for_attempt(Job.objects.get(pk=pair.pk))
    # Superseded: whatever it claims, the old credential only tells its agent to stop.
    assert post(pair, pair.tokens[0], attempt=1).status_code == 410
    assert post(pair, pair.tokens[0], attempt=2).status_code == 410
    assert post(pair, fresh[0], attempt=2).status_code == 200
    assert list(LogLine.objects.values_list("attempt", flat=True)) == [2]


@pytest.mark.parametrize("status", ["HALTING", "STORING", "DOWNLOADING"])
def test_the_attempt_still_lives_while_its_job_is_active_on_it(pair, status):
    Job.objects.filter(pk=pair.pk).update(status=status)
    assert post(pair, pair.tokens[0]).status_code == 200


@pytest.mark.parametrize("body", [b"{not json", b"\xff" * 100, b"[" * 100_000])
def test_a_bad_credential_is_refused_before_the_body_is_parsed(pair, body, monkeypatch):
    def parse(_):
        raise AssertionError("the body was parsed")
    monkeypatch.setattr("jobs.ingest.decode", parse)
    for token in ("", "forged", "x" * 10_000):
        assert post(pair, token, body=body).status_code == 401


def test_a_body_too_big_to_read_gets_401_without_a_credential_and_400_with_one(pair):
    huge = b"x" * (17 * 2**20)  # over DATA_UPLOAD_MAX_MEMORY_SIZE: reading it would fail
    assert post(pair, "forged", body=huge).status_code == 401
    assert post(pair, pair.tokens[0], body=huge).status_code == 400


def test_checking_a_credential_is_one_query(pair, django_assert_num_queries):
    with django_assert_num_queries(1):
        grant = ingest.authenticate(pair.id, pair.tokens[1])
    assert (grant.job_id, grant.attempt, grant.learner, grant.ended) == (pair.id, 1, 1, False)


def test_a_credential_seen_valid_is_not_looked_up_again_and_its_attempt_is_still_checked_at_every_post(
        pair, django_assert_num_queries):
    assert post(pair, pair.tokens[0]).status_code == 200
    with django_assert_num_queries(0):
        grant = ingest.authenticate(pair.id, pair.tokens[0])
    assert (grant.job_id, grant.attempt, grant.learner) == (pair.id, 1, 0)
    assert credentials.check(pair.tokens[0], "another-job") is None
    # Its attempt ends: the remembered grant no longer stores anything (checked under the job's lock).
    Job.objects.filter(pk=pair.pk).update(status="COMPLETED")
    refused = post(pair, pair.tokens[0])
    assert refused.status_code == 410
    assert LogLine.objects.filter(job=pair).count() == 1
    Job.objects.filter(pk=pair.pk).delete()
    assert post(pair, pair.tokens[0]).status_code == 404  # gone with its job: nothing to post to


def test_a_credential_never_seen_valid_is_not_remembered(pair):
    Job.objects.filter(pk=pair.pk).update(status="COMPLETED")
    assert post(pair, pair.tokens[1], learner=1).status_code == 410
    assert credentials.digest(pair.tokens[1]) not in credentials._KNOWN
    assert credentials.digest("forged") not in credentials._KNOWN


def test_the_digest_lookup_is_indexed():
    field = LearnerCredential._meta.get_field("digest")
    assert field.unique  # a unique index: the lookup never scans


def test_a_repeated_deploy_leaves_the_running_agents_credentials_valid(pair):
    again = credentials.issue_for_attempt(pair)
    assert post(pair, pair.tokens[0]).status_code == 200
    assert post(pair, again[1], learner=1).status_code == 200


def test_each_local_agent_gets_its_own_credential_and_nothing_else_carries_it(pair):
    Job.objects.filter(pk=pair.pk).update(status="PENDING")
    spec = deploy_spec(Job.objects.select_related("tenant").get(pk=pair.pk))
    backend, configs = LocalBackend(), []
    for learner in spec.learners:
        configs.append(backend._agent_config(spec, learner, __import__("pathlib").Path("/tmp/l")))
    tokens = [c["ingest_token"] for c in configs]
    assert len(set(tokens)) == 2
    for index, token in enumerate(tokens):
        assert credentials.check(token, pair.id).learner == index
        everything_else = json.dumps({k: v for c in configs for k, v in c.items() if k != "ingest_token"})
        assert token not in everything_else  # not in the learner's env, not in the other learner's config
        assert token not in repr(spec)
