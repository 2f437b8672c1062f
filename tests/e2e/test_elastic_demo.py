"""examples/pytorch-elastic as a new user first tries it: on a platform set up as `make demo` sets
one up (four idle virtual GPUs, TRAINYARD_LOCAL_GPUS; the elastic settings left at their defaults),
submitted with its own manifest. It asks for one virtual GPU per learner, so the autoscaler resizes
it (one learner measured: grown to two, twice its largest measured shape); it reports its gradient
noise scale; it completes.
"""
import pytest

from portal.management.commands.demo import DEMO_VIRTUAL_GPUS
from tests.support.harness import start_session

pytestmark = pytest.mark.e2e


@pytest.fixture
def demo_platform(tmp_path):
    # The demo's GPUs; CPUs named so the learners' `cpus: 1` fit on this machine whatever it has.
    session = start_session(tmp_path, TRAINYARD_LOCAL_GPUS=str(DEMO_VIRTUAL_GPUS), TRAINYARD_LOCAL_CPUS="8",
                            TRAINYARD_RECONCILE_INTERVAL="2")
    try:
        yield session
    finally:
        session.stop()


def test_the_elastic_example_is_resized_on_the_demos_idle_gpus_and_completes(demo_platform):
    session = demo_platform
    job_id = session.submit("pytorch-elastic")["id"]
    done = session.wait_for(job_id, timeout=600, poll=1.0)
    assert done["status"] == "COMPLETED", done["status_reason"]

    timeline = session.api("GET", f"/api/v1/jobs/{job_id}/allocations/").json()
    timeline = timeline.get("results", timeline)
    print(f"\ntimeline: {[(r['learners'], r['global_batch'], r['reason'], r['resize_cost_s']) for r in timeline]}")
    assert timeline[0]["learners"] == 1 and len(timeline) >= 2, timeline
    grow = timeline[1]
    assert grow["learners"] == 2 and grow["reason"].startswith("resized 1→2 learners"), grow
    assert grow["reason"].endswith(": idle GPUs") and grow["resize_cost_s"] > 0
    assert all(32 <= row["global_batch"] <= 128 for row in timeline)
    events = session.api("GET", f"/api/v1/jobs/{job_id}/events/").json()["results"]
    assert any(e["actor"] == "autoscaler" and e["to_status"] == "HALTING" for e in events)

    points = session.api("GET", f"/api/v1/jobs/{job_id}/metrics/", params={"name": "noise_scale"}).json()["results"]
    print(f"noise scale reported: {[round(p['value']) for p in points]}")
    assert points and all(p["value"] > 0 for p in points)
