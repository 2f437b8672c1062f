"""Use per node over time (jobs.node_use, GET /api/v1/cluster/use/): each node's learners' samples,
every tenant's, summed a minute at a time, the learners found on their nodes through their attempts'
placements."""
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import node_use
from jobs.models import Allocation, ResourceSample
from tests.support.builders import client_for, job, member

pytestmark = pytest.mark.django_db

NOW = timezone.now().replace(second=30, microsecond=0)
PAST_MINUTE = NOW.replace(second=0) - timedelta(minutes=2)


def placed(row, attempt, *nodes):
    Allocation.objects.create(job=row, attempt=attempt, learners=len(nodes), placement=[
        {"node": node, "gpu_ids": [i]} for i, node in enumerate(nodes)])


def samples(row, learner, count, *, cpu, busy=None, attempt=1, start=PAST_MINUTE):
    for i in range(count):
        ResourceSample.objects.create(job=row, attempt=attempt, learner=learner, time=start + timedelta(seconds=5 * i),
                                      cpu_cores=cpu, memory_bytes=1, memory_peak_bytes=1, gpus_busy=busy)


def test_a_node_sums_its_learners_of_every_tenant_a_minute_at_a_time(settings):
    settings.RESOURCE_SAMPLE_S = 5.0
    alices = job(member())
    bobs = job(member("team-b", "bob"))
    placed(alices, 1, "n1", "n2")
    placed(bobs, 1, "n2")
    samples(alices, 0, 12, cpu=1.0)  # a minute of samples: one core
    samples(alices, 1, 12, cpu=0.5, busy=0.5)  # half a core, half a GPU busy
    samples(bobs, 0, 6, cpu=2.0, busy=2.0)  # half a minute at two cores and two GPUs: one and one
    history = {n["name"]: n["points"] for n in node_use.history(60, now=NOW)}
    assert history == {
        "n1": [{"time": PAST_MINUTE, "cpu_cores": 1.0, "gpus_busy": None}],
        "n2": [{"time": PAST_MINUTE, "cpu_cores": 1.5, "gpus_busy": 1.5}],
    }


def test_a_learner_sending_more_samples_than_its_period_allows_counts_once(settings):
    """1,000 samples in one minute (a hostile agent's, past what ingest refuses) are that learner's mean."""
    settings.RESOURCE_SAMPLE_S = 5.0
    row = job(member())
    placed(row, 1, "n1")
    ResourceSample.objects.bulk_create(
        ResourceSample(job=row, attempt=1, learner=0, time=PAST_MINUTE, cpu_cores=1.0, memory_bytes=1,
                       memory_peak_bytes=1, gpus_busy=1.0) for _ in range(1000))
    history = {n["name"]: n["points"] for n in node_use.history(60, now=NOW)}
    assert history == {"n1": [{"time": PAST_MINUTE, "cpu_cores": 1.0, "gpus_busy": 1.0}]}


def test_a_learner_counts_where_its_attempt_ran_and_the_current_minute_over_its_part_gone_by(settings):
    settings.RESOURCE_SAMPLE_S = 5.0
    row = job(member())
    placed(row, 1, "n1")
    placed(row, 2, "n2")  # resumed elsewhere
    samples(row, 0, 12, cpu=1.0, attempt=1)
    samples(row, 0, 6, cpu=1.0, attempt=2, start=NOW.replace(second=0))  # 30 s of the current minute
    history = {n["name"]: n["points"] for n in node_use.history(60, now=NOW)}
    assert [p["cpu_cores"] for p in history["n1"]] == [1.0]
    assert history["n2"] == [{"time": NOW.replace(second=0), "cpu_cores": 1.0, "gpus_busy": None}]


def test_samples_before_the_window_or_of_an_attempt_never_placed_count_nowhere(settings):
    row = job(member())
    placed(row, 1, "n1")
    samples(row, 0, 3, cpu=1.0, start=NOW - timedelta(minutes=90))
    samples(row, 0, 3, cpu=1.0, attempt=2)  # no Allocation row: it never ran
    assert node_use.history(60, now=NOW) == []


def test_the_api_answers_totals_and_checks_its_window():
    row = job(member())
    placed(row, 1, "local")
    samples(row, 0, 3, cpu=1.0, start=timezone.now() - timedelta(minutes=1))
    client = client_for(member("team-b", "bob"))  # another tenant sees the node's totals, named by no job
    body = client.get("/api/v1/cluster/use/").json()
    assert body["minutes"] == 60 and [n["name"] for n in body["nodes"]] == ["local"]
    assert set(body["nodes"][0]["points"][0]) == {"time", "cpu_cores", "gpus_busy"}
    refused = client.get("/api/v1/cluster/use/?minutes=100000")
    assert refused.status_code == 400 and refused.json()["field"] == "minutes"


def test_the_history_is_computed_once_a_minute_for_every_caller():
    import time

    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    if time.time() % 60 > 55:  # both requests in one minute
        time.sleep(6)
    row = job(member())
    placed(row, 1, "local")
    samples(row, 0, 3, cpu=1.0, start=timezone.now() - timedelta(minutes=1))
    first = client_for(member("team-b", "bob")).get("/api/v1/cluster/use/").json()
    with CaptureQueriesContext(connection) as queries:
        assert client_for(member("team-c", "carol")).get("/api/v1/cluster/use/").json() == first
    assert not [q for q in queries if ResourceSample._meta.db_table in q["sql"]]


def test_a_tenant_has_one_history_computed_at_a_time():
    from tenants import throttling
    bob = member("team-b", "bob")
    with throttling.slot(throttling.CLUSTER_HISTORY, bob.tenant_id) as held:  # one of team-b's, still running
        assert held
        refused = client_for(member("team-b", "dave")).get("/api/v1/cluster/use/")
        assert refused.status_code == 429 and refused["Retry-After"]
        assert client_for(member("team-c", "carol")).get("/api/v1/cluster/use/").status_code == 200
    assert client_for(bob).get("/api/v1/cluster/use/").status_code == 200


def test_callers_asking_for_each_length_in_turn_share_the_few_computed_windows():
    """A member walking ?minutes= through 1..1440 must not have every tenant's samples summed again for each."""
    import time

    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    if time.time() % 60 > 50:  # every request in one minute
        time.sleep(11)
    row = job(member())
    placed(row, 1, "local")
    now = timezone.now()
    samples(row, 0, 1, cpu=1.0, start=now - timedelta(minutes=90))
    samples(row, 0, 1, cpu=2.0, start=now - timedelta(seconds=30))
    client = client_for(member("team-b", "bob"))
    assert [len(n["points"]) for n in client.get("/api/v1/cluster/use/?minutes=360").json()["nodes"]] == [2]
    with CaptureQueriesContext(connection) as queries:
        for minutes, shown in ((359, 2), (89, 1), (61, 1)):  # the sample 90 minutes ago is in the first only
            body = client.get(f"/api/v1/cluster/use/?minutes={minutes}").json()
            assert body["minutes"] == minutes and [len(n["points"]) for n in body["nodes"]] == [shown]
    assert not [q for q in queries if ResourceSample._meta.db_table in q["sql"]]


def test_the_cluster_asks_the_backend_for_its_nodes_once_a_period_for_every_caller(monkeypatch):
    """On Kubernetes each ask lists every Node: a member refreshing the cluster page, or a script
    polling it, must not make the API server do it for each request."""
    import time

    from jobs import api
    from jobs.backends import get_backend
    backend, asked = get_backend(), []
    real = backend.capacity
    monkeypatch.setattr(backend, "capacity", lambda: asked.append(1) or real())
    monkeypatch.setattr(api, "CAPACITY_SHARED_S", 1.0)
    if time.time() % 1 > 0.7:  # the first requests in one period
        time.sleep(0.35)
    first = client_for(member("team-b", "bob")).get("/api/v1/cluster/").json()
    again = [client_for(member(f"team-{t}", f"user-{t}")).get("/api/v1/cluster/").json() for t in "cd"]
    assert len(asked) == 1 and all(body["nodes"] == first["nodes"] for body in again)
    time.sleep(1.05)
    assert client_for(member("team-b", "bob")).get("/api/v1/cluster/").json()["gpus_total"] == first["gpus_total"]
    assert len(asked) == 2  # the next period asks again
