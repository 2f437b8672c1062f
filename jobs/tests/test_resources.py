"""Resource samples (learner_agent.telemetry): stored from ingest one record at a time, a hostile one
refused by name, and read back through GET /api/v1/jobs/<id>/resources/ by the job's tenant only."""
import time

import pytest

from jobs.ingest import SAMPLE_AHEAD_S, SAMPLE_BACKLOG_S
from jobs.models import Job, LogLine, ResourceSample
from jobs.serializers import ResourceSampleSerializer
from tests.support.builders import client_for, job, member, post

pytestmark = pytest.mark.django_db
PERIOD_S = 5.0  # TRAINYARD_RESOURCE_SAMPLE_S here: the agent's sampling period
T0 = time.time() - 1800  # the first sample's time: a real agent's are recent (reset for each test)

GPU = {"index": 0, "utilization": 97.0, "memory_used_bytes": 40 * 2**30, "memory_total_bytes": 80 * 2**30,
       "power_watts": 650.5, "learner_memory_bytes": 30 * 2**30}


@pytest.fixture
def running_job(running_job, settings):
    """The running job of every test here, with the GPU per learner its samples name; its samples
    start half an hour before the test runs."""
    global T0
    T0 = time.time() - 1800
    settings.RESOURCE_SAMPLE_S = PERIOD_S
    Job.objects.filter(pk=running_job.pk).update(gpus=1)
    return running_job


def sample(seq, **fields):
    """Sample `seq`, one sampling period after the one before it."""
    record = {"seq": seq, "kind": "resource", "time": T0 + PERIOD_S * seq, "cpu_cores": 0.98,
              "memory_bytes": 300 * 2**20, "memory_peak_bytes": 320 * 2**20, "memory_limit_bytes": 2**30, "gpus": [GPU]}
    record.update(fields)
    return record


def test_it_stores_resource_samples_beside_the_log(running_job):
    records = [sample(1), {"seq": 2, "kind": "log", "stream": "stdout", "time": 2.0, "line": "step 1"},
               sample(3, gpus=[], memory_limit_bytes=None)]
    assert post(running_job, records).json() == {"acked": 3}
    first, second = ResourceSample.objects.order_by("id")
    assert (first.job_id, first.attempt, first.learner, first.cpu_cores) == (running_job.id, 1, 0, 0.98)
    assert (first.memory_bytes, first.memory_peak_bytes, first.memory_limit_bytes) == (300 * 2**20, 320 * 2**20, 2**30)
    assert first.gpus == [GPU] and first.time.timestamp() == pytest.approx(T0 + PERIOD_S)
    assert second.gpus == [] and second.memory_limit_bytes is None
    assert (first.gpu_utilization, second.gpu_utilization) == (97.0, None)  # the busiest GPU, for jobs.idle
    assert (first.gpus_busy, second.gpus_busy) == (0.97, None)  # GPUs busy, for jobs.usage
    assert LogLine.objects.count() == 1


def test_a_page_of_samples_is_what_the_schema_says(running_job):
    """The page is built by hand (jobs.serializers.resource_sample_json) for speed; each sample must be
    what ResourceSampleSerializer, which the OpenAPI schema gives, makes of it."""
    post(running_job, [sample(1), sample(2, gpus=[{**GPU, "power_watts": None}], memory_limit_bytes=None)])
    page = client_for(member()).get(f"/api/v1/jobs/{running_job.id}/resources/").json()
    assert page["results"] == ResourceSampleSerializer(ResourceSample.objects.order_by("id"), many=True).data


def test_a_resend_stores_each_sample_once(running_job):
    post(running_job, [sample(1), sample(2)])
    assert post(running_job, [sample(1), sample(2), sample(3)]).json() == {"acked": 3}
    assert ResourceSample.objects.count() == 3


def test_a_gpu_keeps_only_the_fields_a_sample_has(running_job):
    post(running_job, [sample(1, gpus=[{**GPU, "uuid": "GPU-aaaa", "extra": "x" * 1000, "utilization": None}])])
    assert ResourceSample.objects.get().gpus == [{**GPU, "utilization": None}]


@pytest.mark.parametrize("fields, error", [
    ({"cpu_cores": -1}, "cpu_cores: must be a number between 0 and 100000"),
    ({"cpu_cores": "lots"}, "cpu_cores: must be a number"),
    ({"cpu_cores": True}, "cpu_cores: must be a number"),
    ({"memory_bytes": 2**64}, "memory_bytes: must be an integer between 0 and 2**63-1"),
    ({"memory_peak_bytes": None}, "memory_peak_bytes: must be an integer"),
    ({"memory_limit_bytes": -5}, "memory_limit_bytes: must be null or an integer"),
    ({"gpus": {"index": 0}}, "gpus: must be a list of at most 64 GPUs"),
    ({"gpus": [GPU] * 65}, "gpus: must be a list of at most 64 GPUs"),
    ({"gpus": ["GPU0"]}, "gpus[0].index: each GPU must be an object"),
    ({"gpus": [GPU, {**GPU, "index": 64}]}, "gpus[1].index: must be an integer between 0 and 63"),
    ({"gpus": [{**GPU, "utilization": 101}]}, "gpus[0].utilization: must be null or a number between 0 and 100"),
    ({"gpus": [{**GPU, "power_watts": 1e300}]}, "gpus[0].power_watts: must be null or a number"),
    ({"gpus": [{**GPU, "learner_memory_bytes": 1.5}]}, "gpus[0].learner_memory_bytes: must be null or an integer"),
    ({"time": -1}, "time: must be Unix seconds"),
])
def test_a_hostile_sample_is_refused_by_name_and_the_rest_stored(running_job, fields, error):
    answer = post(running_job, [sample(1), sample(2, **fields), sample(3)]).json()
    assert answer["acked"] == 3
    assert [r["seq"] for r in answer["rejected"]] == [2] and answer["rejected"][0]["error"].startswith(error)
    assert ResourceSample.objects.count() == 2


@pytest.mark.parametrize("fields, error", [
    ({"gpus": [GPU, GPU]}, "gpus: each of the learner's 1 GPUs at most once"),
    ({"gpus": [GPU, {**GPU, "index": 1}]}, "gpus: each of the learner's 1 GPUs at most once, by its index (0 to 0)"),
    ({"time": lambda: T0 + PERIOD_S * 0.5}, "time: before the learner's last resource sample"),
    ({"time": lambda: time.time() - SAMPLE_BACKLOG_S - 60}, "time: a resource sample is kept from 3600 s before"),
    ({"time": lambda: time.time() + SAMPLE_AHEAD_S + 60}, "time: a resource sample is kept from 3600 s before"),
], ids=["gpu-twice", "gpu-not-its-own", "out-of-order", "too-old", "ahead"])
def test_a_sample_its_learner_could_not_have_taken_is_refused_by_name(running_job, fields, error):
    fields = {name: value() if callable(value) else value for name, value in fields.items()}  # times: now's
    answer = post(running_job, [sample(1), sample(2, **fields), sample(3)]).json()
    assert [r["seq"] for r in answer["rejected"]] == [2] and answer["rejected"][0]["error"].startswith(error)
    assert ResourceSample.objects.count() == 2


def test_the_last_sample_as_the_learner_ends_is_kept_however_soon_but_no_more(running_job):
    """The agent samples once more as its learner ends (learner_agent.telemetry: stop); a third sample
    in half a period is one no agent sends."""
    answer = post(running_job, [sample(1), sample(2), sample(3, time=T0 + PERIOD_S * 2 + 0.1),
                                sample(4, time=T0 + PERIOD_S * 2 + 0.2)]).json()
    assert [r["seq"] for r in answer["rejected"]] == [4]
    assert answer["rejected"][0]["error"].startswith("time: a learner's resource samples come one per 5 s")
    assert ResourceSample.objects.count() == 3


def test_a_learner_with_no_gpus_sends_samples_without_any(running_job):
    Job.objects.filter(pk=running_job.pk).update(gpus=0)
    answer = post(running_job, [sample(1, gpus=[]), sample(2)]).json()
    assert answer["rejected"] == [{"seq": 2, "error": "gpus: the learner has no GPUs"}]


def test_what_one_credential_stores_grows_with_time_not_with_how_fast_it_posts(running_job):
    """A stolen credential posting 5,000 samples stamped alike, twice, stores two: what it may add is
    two samples per half period of the time it runs, however fast it posts."""
    now = time.time()
    for first in (1, 5001):
        post(running_job, [sample(seq, time=now) for seq in range(first, first + 5000)])
    assert ResourceSample.objects.count() == 2
    assert post(running_job, [sample(10_001, time=now + PERIOD_S)]).json() == {"acked": 10_001}
    assert ResourceSample.objects.count() == 3


def test_nan_in_a_sample_is_refused_not_the_batch(running_job):
    body = ('{"attempt": 1, "learner": 0, "records": [{"seq": 1, "kind": "resource", "cpu_cores": NaN, '
            '"memory_bytes": 1, "memory_peak_bytes": 1}, {"seq": 2, "kind": "resource", "cpu_cores": 1.0, '
            '"memory_bytes": 1, "memory_peak_bytes": 1}]}')
    from django.test import Client
    response = Client().post(f"/api/v1/ingest/{running_job.id}/", body, content_type="application/json",
                             HTTP_AUTHORIZATION=f"Ingest {running_job.tokens[0]}")
    assert response.json()["acked"] == 2 and [r["seq"] for r in response.json()["rejected"]] == [1]
    assert ResourceSample.objects.count() == 1


# --- GET /api/v1/jobs/<id>/resources/ ---

def test_it_pages_the_samples_oldest_first(running_job):
    post(running_job, [sample(seq, cpu_cores=seq / 10) for seq in range(1, 6)])
    client = client_for(member())
    url = f"/api/v1/jobs/{running_job.id}/resources/"
    first = client.get(url, {"limit": 2}).json()
    assert [s["cpu_cores"] for s in first["results"]] == [0.1, 0.2] and first["more"] is True
    assert first["results"][0]["gpus"] == [GPU] and first["results"][0]["memory_limit_bytes"] == 2**30
    assert set(first["results"][0]) == {"id", "attempt", "learner", "time", "cpu_cores", "memory_bytes",
                                        "memory_peak_bytes", "memory_limit_bytes", "gpus"}
    rest = client.get(url, {"after": first["next_after"], "limit": 10}).json()
    assert [s["cpu_cores"] for s in rest["results"]] == [0.3, 0.4, 0.5] and rest["more"] is False
    empty = client.get(url, {"after": rest["next_after"]}).json()
    assert empty == {"results": [], "next_after": rest["next_after"], "more": False}


@pytest.mark.parametrize("params", [{"limit": 0}, {"limit": 5001}, {"after": -1}, {"after": "x"}])
def test_it_refuses_a_bad_page_with_400(running_job, params):
    response = client_for(member()).get(f"/api/v1/jobs/{running_job.id}/resources/", params)
    assert response.status_code == 400


def test_an_outsider_gets_404(running_job):
    post(running_job, [sample(1)])
    outsider = client_for(member("team-b", "bob", role="admin"))
    assert outsider.get(f"/api/v1/jobs/{running_job.id}/resources/").status_code == 404


def test_only_the_jobs_own_samples_are_listed(running_job):
    other = job(member(), status="PENDING")
    ResourceSample.objects.create(job=other, time=running_job.created_at, cpu_cores=3.0, memory_bytes=1,
                                  memory_peak_bytes=1)
    post(running_job, [sample(1)])
    listed = client_for(member()).get(f"/api/v1/jobs/{running_job.id}/resources/").json()["results"]
    assert [s["cpu_cores"] for s in listed] == [0.98]
