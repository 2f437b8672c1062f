"""The job page's resource charts in a real Chromium against the real platform: a job whose learner
grows past its memory limit on the local backend ends FAILED, and its page says it was killed for
memory above the curve that led there, with its CPU beside it; the cluster page charts what its node's
learners used."""
import json
import tempfile
from pathlib import Path

import pytest

from tests.support.browser import log_in
from tests.support.harness import start_session
from trainyard.packing import code_upload

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

SCREENSHOTS = Path(tempfile.gettempdir()) / "trainyard-screenshots"
WAIT_MS = 90_000
MANIFEST = """
name: memory-hog
learners: 1
gpus: 0
cpus: 1
memory: 128MiB
framework: {name: custom, command: python3 grow.py}
"""
# Every page of each chunk written, so it is resident; slow enough for the agent to sample the climb.
GROW = """
import time
held = []
while True:
    chunk = bytearray(8 * 2**20)
    chunk[::4096] = b"x" * (len(chunk) // 4096)
    held.append(chunk)
    print(f"holding {len(held) * 8} MiB", flush=True)
    time.sleep(0.4)
"""


@pytest.fixture
def sampling_platform(tmp_path):
    session = start_session(tmp_path / "platform", TRAINYARD_RESOURCE_SAMPLE_S="0.5", TRAINYARD_RECONCILE_INTERVAL="2")
    try:
        yield session
    finally:
        session.stop()


def submit(platform, tmp_path):
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "grow.py").write_text(GROW)
    code = code_upload(str(folder))
    with code.fileobj:
        response = platform.api("POST", "/api/v1/jobs/", files={
            "manifest": ("manifest.yml", MANIFEST), "code": (code.filename, code.fileobj.read())})
    assert response.status_code == 201, response.text
    return response.json()


def test_a_job_killed_for_memory_shows_the_curve_that_led_there(browser, sampling_platform, tmp_path):
    job = submit(sampling_platform, tmp_path)
    detail = sampling_platform.wait_for(job["id"], {"FAILED", "COMPLETED", "TERMINATED"}, timeout=120)
    assert detail["status"] == "FAILED" and "memory limit" in detail["status_reason"], detail
    samples = sampling_platform.api("GET", f"/api/v1/jobs/{job['id']}/resources/").json()["results"]
    assert len(samples) >= 4
    assert all(s["memory_limit_bytes"] == 128 * 2**20 for s in samples)
    # The climb: memory grew sample after sample towards the limit.
    climbing = [s["memory_bytes"] for s in samples if s["memory_bytes"]]
    assert max(climbing) > climbing[0] and max(climbing) > 64 * 2**20
    # Sampled every 0.5 s (and read from RSS where no control group counts it), the peak seen comes near the limit.
    assert max(s["memory_peak_bytes"] for s in samples) >= 96 * 2**20

    page = log_in(browser, sampling_platform.url, sampling_platform.username, sampling_platform.password,
                  timeout_ms=WAIT_MS)
    try:
        page.goto(f"{sampling_platform.url}/jobs/{job['id']}/")
        page.wait_for_function(f"() => Number(document.querySelector('[data-testid=resources]').dataset.sampleCount) "
                               f">= {len(samples)}")
        oom = page.locator("[data-testid=resources-oom]")
        oom.wait_for(state="visible")
        assert oom.inner_text().startswith("Killed for exceeding its memory limit of 128 MiB")
        memory = page.locator("[data-testid=resource-chart][data-chart=memory]")
        # One point per time it was sampled at, to the millisecond the page reads times in (the agent's
        # last sample as its learner ends may share one with the sample before it).
        assert int(memory.get_attribute("data-point-count")) >= len({s["time"][:23] for s in samples})
        # learner 0, its peak, and the limit
        assert memory.get_attribute("data-series-count") == "3"
        assert memory.locator(".u-legend").inner_text().count("limit") == 1
        assert page.locator("[data-testid=resource-chart][data-chart=cpu]").count() == 1
        assert page.locator("[data-testid=resource-chart][data-chart=gpu-utilization]").count() == 0  # no GPUs
        assert page.locator("[data-testid=resources-empty]").is_hidden()
        section = page.locator("[data-testid=resources]")
        section.scroll_into_view_if_needed()
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        section.screenshot(path=str(SCREENSHOTS / "resources-oom.png"))
        # Each GPU of a learner is a line of its own on the GPU charts (samples written as ingest writes them).
        sampling_platform.manage("shell", "-v", "0", "-c", GPU_SAMPLES.replace("JOB_ID", json.dumps(job["id"])))
        page.reload()
        page.wait_for_selector("[data-testid=resource-chart][data-chart=gpu-utilization]")
        for chart in ("gpu-utilization", "gpu-memory", "gpu-power"):
            assert page.get_attribute(f"[data-testid=resource-chart][data-chart={chart}]", "data-series-count") == "2"
        legend = page.locator("[data-testid=resource-chart][data-chart=gpu-utilization] .u-legend").inner_text()
        assert "GPU 0" in legend and "GPU 1" in legend
        page.locator("[data-testid=resources]").screenshot(path=str(SCREENSHOTS / "resources-gpus.png"))

        # The cluster page: what the node's learners used, a minute at a time (the job ran on `local`).
        page.goto(f"{sampling_platform.url}/cluster/")
        cpu = page.locator("[data-testid=node-use-chart][data-chart=cpu]")
        cpu.wait_for(state="visible")
        assert cpu.get_attribute("data-series-count") == "1" and int(cpu.get_attribute("data-point-count")) >= 1
        assert "local" in cpu.locator(".u-legend").inner_text()
        assert page.locator("[data-testid=node-use-chart][data-chart=gpu]").count() == 0  # no sample read a GPU busy
        assert page.locator("[data-testid=node-use-empty]").is_hidden()
        page.locator("[data-testid=cluster-page]").screenshot(path=str(SCREENSHOTS / "cluster-node-use.png"))
    finally:
        page.close()


GPU_SAMPLES = """
from datetime import timedelta
from jobs.models import Job, ResourceSample
job = Job.objects.get(id=JOB_ID)
last = job.resource_samples.order_by("time").last()
for i in range(1, 6):
    gpus = [{"index": g, "utilization": 90.0 - 40 * g + i, "memory_used_bytes": (20 + g) * 2**30,
             "memory_total_bytes": 80 * 2**30, "power_watts": 600.0 - 200 * g, "learner_memory_bytes": (18 + g) * 2**30}
            for g in (0, 1)]
    ResourceSample.objects.create(job=job, attempt=1, learner=0, time=last.time + timedelta(seconds=i), cpu_cores=1.0,
                                  memory_bytes=2**26, memory_peak_bytes=2**27, memory_limit_bytes=2**27, gpus=gpus)
"""
