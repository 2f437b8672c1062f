"""An elastic job as people read it over REST: the detail's `elastic`, the allocation timeline, the
cluster's elastic sizes (jobs.elastic_timeline). Allocation rows are written directly, as the platform's
resize writes them."""
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.models import Allocation
from tests.support.builders import client_for, job, member

pytestmark = pytest.mark.django_db

ELASTIC = {"min_learners": 1, "max_learners": 4, "batch": {"global": 256, "min": 64, "max": 1024},
           "lr_scaling": "linear"}


@pytest.fixture
def alice():
    return member("team-a", "alice")


def elastic_job(membership, **fields):
    target = job(membership, **fields)
    target.runtime = dict(target.runtime, elastic=ELASTIC)
    target.save(update_fields=["runtime"])
    return target


def resized_twice(target, start=None):
    """Attempts 1 (2 learners), 2 (4, grown onto idle GPUs) and 3 (2, shrunk; still running)."""
    t0 = start or timezone.now() - timedelta(minutes=10)
    rows = [
        Allocation(job=target, attempt=1, learners=2, global_batch=256, local_batch=128, lr_scale=1.0,
                   reason="admitted at 2 of 1–4 learners", started_at=t0, ended_at=t0 + timedelta(seconds=100),
                   samples_start=0, samples_end=25_600),
        Allocation(job=target, attempt=2, learners=4, global_batch=512, local_batch=128, lr_scale=2.0,
                   reason="resized 2→4 learners, batch 256→512: idle GPUs",
                   resize_requested_at=t0 + timedelta(seconds=100), resize_cost_s=7.5,
                   started_at=t0 + timedelta(seconds=107.5), ended_at=t0 + timedelta(seconds=207.5),
                   samples_start=25_600, samples_end=76_800),
        Allocation(job=target, attempt=3, learners=2, global_batch=256, local_batch=128, lr_scale=1.0,
                   reason="resized 4→2 learners, batch 512→256: queued work of its tenant",
                   resize_requested_at=t0 + timedelta(seconds=207.5), resize_cost_s=6.0,
                   started_at=t0 + timedelta(seconds=213.5), samples_start=76_800),
    ]
    Allocation.objects.bulk_create(rows)
    target.attempt, target.learners = 3, 2
    target.save(update_fields=["attempt", "learners"])
    return rows


def test_it_lists_the_timeline_oldest_first_with_measured_throughput(alice):
    target = elastic_job(alice, status="PROCESSING")
    resized_twice(target)
    rows = client_for(alice).get(f"/api/v1/jobs/{target.id}/allocations/").json()["results"]
    assert [(r["attempt"], r["learners"], r["global_batch"], r["local_batch"], r["lr_scale"]) for r in rows] == [
        (1, 2, 256, 128, 1.0), (2, 4, 512, 128, 2.0), (3, 2, 256, 128, 1.0)]
    assert [r["samples_per_s"] for r in rows] == [256.0, 512.0, None]  # the open stretch is not measured yet
    assert [r["resize_cost_s"] for r in rows] == [None, 7.5, 6.0]
    assert rows[1]["reason"] == "resized 2→4 learners, batch 256→512: idle GPUs"
    assert rows[2]["ended_at"] is None and rows[0]["started_at"].endswith(("Z", "+00:00"))


def test_the_detail_says_the_bounds_and_the_current_shape(alice):
    target = elastic_job(alice, status="PROCESSING")
    resized_twice(target)
    elastic = client_for(alice).get(f"/api/v1/jobs/{target.id}/").json()["elastic"]
    assert elastic == {"min_learners": 1, "max_learners": 4, "batch": {"global": 256, "min": 64, "max": 1024},
                       "lr_scaling": "linear", "learners": 2, "global_batch": 256, "local_batch": 128,
                       "lr_scale": 1.0, "allocation_attempt": 3}


def test_an_elastic_job_without_allocations_yet_has_bounds_and_no_batch(alice):
    target = elastic_job(alice)
    elastic = client_for(alice).get(f"/api/v1/jobs/{target.id}/").json()["elastic"]
    assert (elastic["max_learners"], elastic["global_batch"], elastic["allocation_attempt"]) == (4, None, None)
    assert client_for(alice).get(f"/api/v1/jobs/{target.id}/allocations/").json() == {"results": []}


def test_a_fixed_job_has_no_elastic_block(alice):
    target = job(alice)
    assert client_for(alice).get(f"/api/v1/jobs/{target.id}/").json()["elastic"] is None


def test_another_tenants_timeline_is_404_and_names_nothing_of_it(alice):
    secret = elastic_job(alice, status="PROCESSING", name="secret-name")
    resized_twice(secret)
    outsider = client_for(member("team-b", "bob", role="admin"))
    response = outsider.get(f"/api/v1/jobs/{secret.id}/allocations/")
    assert response.status_code == 404
    assert b"idle GPUs" not in response.content and b"secret-name" not in response.content


def test_a_private_job_timeline_is_404_to_a_colleague_it_is_not_shared_with(alice):
    secret = elastic_job(alice, private=True)
    resized_twice(secret)
    colleague = client_for(member("team-a", "carol"))
    assert colleague.get(f"/api/v1/jobs/{secret.id}/allocations/").status_code == 404


def test_the_cluster_shows_an_elastic_jobs_current_and_maximum_size(alice):
    target = elastic_job(alice, status="PROCESSING")
    resized_twice(target)
    target.placement = [{"node": "local", "gpu_ids": [0]}, {"node": "local", "gpu_ids": [1]}]
    target.save(update_fields=["placement"])
    fixed = job(alice, status="PROCESSING", placement=[{"node": "local", "gpu_ids": [2]}])
    rows = {j["id"]: j for n in client_for(alice).get("/api/v1/cluster/").json()["nodes"] for j in n["my_jobs"]}
    assert rows[target.id]["elastic"] == {"learners": 2, "min_learners": 1, "max_learners": 4}
    assert rows[target.id]["learners"] == 2 and rows[fixed.id]["elastic"] is None
