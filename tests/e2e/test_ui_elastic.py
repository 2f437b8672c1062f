"""The job page of an elastic job in a real Chromium against the real platform: the chart of learners,
global batch and samples/s over its allocation timeline, kept live over the websocket, and the cluster
page's elastic size.

One test follows a real resize: a shell job on the local backend with 4 virtual GPUs starts at 1
learner and the autoscaler grows it while the page is open. Another draws a known story exactly: a job
that ran, with allocation rows and `samples` points written into the platform's database as a resize
writes them (`manage.py shell`), and new ones published through jobs.live as ingest and the state
machine publish them, so the rates the page measures can be checked against the figures written.
"""
import json
import re
from pathlib import Path

import pytest

from tests.support.harness import EXAMPLES, start_session
from tests.support.pages import CONNECTED, SCREENSHOTS, log_in, shoot, wait_more
from tests.support.submitting import submit_folder

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

SECTION = "[data-testid=elastic]"
ELASTIC_SHELL = Path(__file__).parent / "jobs" / "elastic-shell"
ELASTIC_SHELL_MANIFEST = """
name: elastic-shell
learners: 1
gpus: 1
cpus: 0.5
memory: 128MiB
framework: {name: custom, command: bash run.sh}
elastic: {min_learners: 1, max_learners: 4, batch_size: {global: 64, min: 32, max: 256}, lr_scaling: linear}
checkpoint: {signal: SIGTERM, grace_seconds: 10}
"""
RESIZE_WAIT_MS = 240_000


@pytest.fixture
def four_gpus(tmp_path):
    """A platform of its own with 4 virtual GPUs and an autoscaler that looks every 2 s (and resizes a job
    at most once in 10 minutes, so the one grow this test waits for is the only one)."""
    session = start_session(tmp_path, TRAINYARD_LOCAL_GPUS="4", TRAINYARD_LOCAL_CPUS="8",
                            TRAINYARD_RECONCILE_INTERVAL="2", TRAINYARD_ELASTIC_INTERVAL="2",
                            TRAINYARD_ELASTIC_MIN_INTERVAL="600", TRAINYARD_ELASTIC_HORIZON="600")
    try:
        yield session
    finally:
        session.stop()


def test_the_chart_follows_a_real_resize_live(browser, four_gpus):
    job = submit_folder(four_gpus, ELASTIC_SHELL, ELASTIC_SHELL_MANIFEST)
    four_gpus.wait_for(job["id"], {"PROCESSING", "HALTING", "STORING", "PENDING", "DOWNLOADING"}, timeout=90)
    page = log_in(browser, four_gpus.url, four_gpus.username, four_gpus.password)
    try:
        page.goto(f"{four_gpus.url}/jobs/{job['id']}/")
        page.wait_for_selector(CONNECTED)
        # The autoscaler grows it onto idle GPUs once it has measured it (to 2, twice the shape it
        # measured); the page hears the new attempt over the websocket and draws its stretch, and rank
        # 0's reports of it as rates.
        page.wait_for_function(f"() => document.querySelector('{SECTION}').dataset.allocationCount === '2'",
                               timeout=RESIZE_WAIT_MS)
        page.wait_for_function("""() => window.Trainyard.page.elastic.points.some((p) => p.attempt === 2)
                                  && Number(document.querySelector('[data-testid=elastic]').dataset.ratePoints) > 2""",
                               timeout=RESIZE_WAIT_MS)
        detail = four_gpus.job(job["id"])
        first, second = four_gpus.api("GET", f"/api/v1/jobs/{job['id']}/allocations/").json()["results"][:2]
        assert (first["learners"], second["learners"]) == (1, detail["elastic"]["learners"]) and second["learners"] > 1
        assert second["reason"].startswith("resized 1→") and second["reason"].endswith(": idle GPUs")
        assert page.locator("[data-testid=elastic-now]").inner_text().startswith(
            f"{second['learners']} of 1–4 learners · batch {second['global_batch']}")
        assert page.locator("[data-field=learners]").inner_text() == str(second["learners"])
        page.locator(SECTION).scroll_into_view_if_needed()
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.locator(SECTION).screenshot(path=str(SCREENSHOTS / "elastic-chart-real.png"))
        # The CLI, against the same platform, prints the same timeline.
        shown = four_gpus.cli("show", job["id"])
        assert shown.returncode == 0, shown.stderr
        timeline = shown.stdout.split("allocations\n", 1)[1].splitlines()
        assert timeline[0].split()[:3] == ["ATTEMPT", "LEARNERS", "BATCH"]
        assert timeline[2].split()[:3] == ["2", str(second["learners"]), str(second["global_batch"])]
        assert second["reason"] in timeline[2]
    finally:
        page.close()
        four_gpus.api("POST", f"/api/v1/jobs/{job['id']}/terminate/")
        four_gpus.wait_for(job["id"])

# Three stretches: 2 learners at batch 256, grown to 4 at 512 (7.5 s resize), shrunk to 2 at 256 (6 s);
# rank 0 reports cumulative samples every second at 250, 480 and 245 samples/s.
MAKE_ELASTIC = """
import json
from datetime import timedelta
from django.utils import timezone
from jobs.models import Allocation, Job, MetricPoint
job = Job.objects.get(pk=JOB_ID)
job.runtime = dict(job.runtime, elastic={"min_learners": 1, "max_learners": 4, "lr_scaling": "linear",
                                          "batch": {"global": 256, "min": 64, "max": 1024}})
job.attempt, job.learners = 3, 2
job.save(update_fields=["runtime", "attempt", "learners"])
Allocation.objects.filter(job=job).delete()  # its one real fixed-size attempt: replaced by the resized story
t0 = timezone.now() - timedelta(seconds=150)
shapes = [(1, 2, 256, 1.0, 0, 60, 250, None, "admitted at 2 of 1-4 learners"),
          (2, 4, 512, 2.0, 67.5, 107.5, 480, 7.5, "resized 2→4 learners, batch 256→512: idle GPUs"),
          (3, 2, 256, 1.0, 113.5, 145, 245, 6.0, "resized 4→2 learners, batch 512→256: queued work of its tenant")]
samples = 0
for attempt, learners, batch, lr, start, end, rate, cost, reason in shapes:
    first = samples
    for second in range(int(end - start) + 1):
        samples = first + rate * second
        MetricPoint.objects.create(job=job, attempt=attempt, learner=0, name="samples", value=samples,
                                   step=samples // batch, time=t0 + timedelta(seconds=start + second))
    Allocation.objects.create(job=job, attempt=attempt, learners=learners, global_batch=batch,
                              local_batch=batch // learners, lr_scale=lr, reason=reason, resize_cost_s=cost,
                              resize_requested_at=t0 + timedelta(seconds=start - cost) if cost else None,
                              started_at=t0 + timedelta(seconds=start), samples_start=first,
                              ended_at=t0 + timedelta(seconds=end) if attempt < 3 else None,
                              samples_end=samples if attempt < 3 else None)
print(json.dumps({"samples": samples}))
"""

# A fourth stretch opens (grown to 3 learners) and rank 0 reports: published as the platform publishes.
RESIZE_LIVE = """
from datetime import timedelta
from django.db import transaction
from jobs import live
from jobs.models import Allocation, Job, MetricPoint
from jobs.serializers import metric_json
job = Job.objects.get(pk=JOB_ID)
last = MetricPoint.objects.filter(job=job, attempt=3, name="samples").latest("time").time
start = last + timedelta(seconds=5)
with transaction.atomic():
    Allocation.objects.filter(job=job, attempt=3).update(ended_at=last, samples_end=SAMPLES)
    Allocation.objects.create(job=job, attempt=4, learners=3, global_batch=384, local_batch=128, lr_scale=1.5,
                              reason="resized 2→3 learners, batch 256→384: idle GPUs", resize_cost_s=5.0,
                              resize_requested_at=last, started_at=start, samples_start=SAMPLES)
    job.attempt, job.learners = 4, 3
    job.save(update_fields=["attempt", "learners"])
    points = [MetricPoint.objects.create(job=job, attempt=4, learner=0, name="samples", value=SAMPLES + 360 * s,
                                         step=(SAMPLES + 360 * s) // 384, time=start + timedelta(seconds=s))
              for s in range(6)]
    live.publish_records_on_commit(job.id, [], [metric_json(p) for p in points])
    live.publish_status_on_commit(job)
"""

# Then its batch changes inside the running attempt: learner 0's `batch_applied` report, as ingest
# stores it, ends attempt 4's stretch and starts the change's (no new attempt).
BATCH_LIVE = """
from datetime import timedelta
from django.db import transaction
from jobs import live
from jobs.models import Allocation, Job, MetricPoint
from jobs.serializers import metric_json
job = Job.objects.get(pk=JOB_ID)
last = MetricPoint.objects.filter(job=job, attempt=4, name="samples").latest("time")
with transaction.atomic():
    Allocation.objects.filter(job=job, attempt=4).update(ended_at=last.time, samples_end=last.value)
    Allocation.objects.create(job=job, attempt=4, kind="batch", learners=3, global_batch=768, local_batch=256,
                              lr_scale=3.0, reason="batch 384→768, no restart: its measured gradient noise scale",
                              resize_cost_s=1.2, resize_requested_at=last.time - timedelta(seconds=1.2),
                              started_at=last.time, samples_start=last.value)
    points = [MetricPoint.objects.create(job=job, attempt=4, learner=0, name="batch_applied", value=1,
                                         step=last.step, time=last.time)]
    points += [MetricPoint.objects.create(job=job, attempt=4, learner=0, name="samples", value=last.value + 700 * s,
                                          step=last.step + s, time=last.time + timedelta(seconds=s))
               for s in range(1, 6)]
    live.publish_records_on_commit(job.id, [], [metric_json(p) for p in points])
"""


def shell(platform, code, **values):
    for name, value in values.items():
        code = code.replace(name, json.dumps(value))
    return platform.manage("shell", "-v", "0", "-c", code)


@pytest.fixture
def elastic_job(live_platform):
    job = live_platform.submit("custom-shell")
    live_platform.wait_for(job["id"])
    made = json.loads(shell(live_platform, MAKE_ELASTIC, JOB_ID=job["id"]).splitlines()[-1])
    return {"id": job["id"], **made}


def test_the_job_page_charts_an_elastic_jobs_learners_batch_and_throughput_live(browser, live_platform,
                                                                                elastic_job):
    page = log_in(browser, live_platform.url, live_platform.username, live_platform.password)
    page.goto(f"{live_platform.url}/jobs/{elastic_job['id']}/")
    page.wait_for_selector(CONNECTED)
    page.wait_for_function(f"() => document.querySelector('{SECTION}').dataset.allocationCount === '3'")
    wait_more(page, SECTION, "data-rate-points", 50)
    # Three panels on one time axis, each a drawn uPlot canvas.
    assert page.locator(f"{SECTION} .elastic-panel").count() == 3
    assert page.locator(f"{SECTION} .elastic-panel canvas").count() == 3
    assert page.locator("[data-testid=elastic-now]").inner_text() == (
        "2 of 1–4 learners · batch 256 (128 each) · lr ×1 (linear)")
    # The measured rate of the last stretch is what rank 0's reports say (245 samples/s), within rounding.
    assert abs(float(page.get_attribute(SECTION, "data-latest-rate")) - 245) < 1
    # The learners panel's legend reads the stretch under the cursor: hover the middle of the chart.
    learners_panel = page.locator(f"{SECTION} .elastic-panel[data-panel=learners] .u-over")
    box = learners_panel.bounding_box()
    middle_of_second = page.evaluate("""() => {
      const chart = window.Trainyard.page.elastic, row = chart.rows[1];
      const t = (Date.parse(row.started_at) + Date.parse(row.ended_at)) / 2000;
      return chart.plots[0].valToPos(t, 'x');
    }""")
    learners_panel.hover(position={"x": middle_of_second, "y": box["height"] / 2})
    legend = page.locator(f"{SECTION} .elastic-panel[data-panel=learners] .u-legend").inner_text()
    assert re.search(r"learners:?\s*4\b", legend), legend
    page.mouse.move(0, 0)
    page.locator(SECTION).scroll_into_view_if_needed()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator(SECTION).screenshot(path=str(SCREENSHOTS / "elastic-chart.png"))

    # Live: the job grows to 3 learners; the page hears the attempt change and the new samples.
    before = int(page.get_attribute(SECTION, "data-rate-points"))
    shell(live_platform, RESIZE_LIVE, JOB_ID=elastic_job["id"], SAMPLES=elastic_job["samples"])
    page.wait_for_function(f"() => document.querySelector('{SECTION}').dataset.allocationCount === '4'")
    assert wait_more(page, SECTION, "data-rate-points", before) > before
    page.wait_for_function("() => document.querySelector('[data-field=attempt]').textContent === '4'")
    assert page.locator("[data-testid=elastic-now]").inner_text() == (
        "3 of 1–4 learners · batch 384 (128 each) · lr ×1.5 (linear)")
    assert page.locator("[data-field=learners]").inner_text() == "3"

    # Live: the batch changes without a restart; the page hears learner 0's report and reloads the timeline.
    shell(live_platform, BATCH_LIVE, JOB_ID=elastic_job["id"])
    page.wait_for_function(f"() => document.querySelector('{SECTION}').dataset.allocationCount === '5'")
    assert page.locator("[data-testid=elastic-now]").inner_text() == (
        "3 of 1–4 learners · batch 768 (256 each) · lr ×3 (linear)")
    assert page.locator("[data-field=attempt]").inner_text() == "4"
    shoot(page, "elastic-job-page.png")
    page.close()


def test_the_cluster_page_shows_an_elastic_jobs_current_and_maximum_size(browser, live_platform):
    manifest = (EXAMPLES / "custom-shell" / "manifest.yml").read_text().replace(
        "bash run.sh", "STEPS=600 bash run.sh") + "elastic: {min_learners: 1, max_learners: 4}\n"
    job = live_platform.submit("custom-shell", manifest_text=manifest)
    live_platform.wait_for(job["id"], {"PROCESSING"}, timeout=90)
    try:
        page = log_in(browser, live_platform.url, live_platform.username, live_platform.password)
        page.goto(f"{live_platform.url}/cluster/")
        badge = page.locator(f"[data-testid=nodes] a:text('{job['id']}') >> xpath=.. >> [data-testid=elastic-size]")
        badge.wait_for()
        # The autoscaler may have grown it meanwhile: whatever it holds, out of at most 4.
        assert re.fullmatch(r"elastic [1-4]/4", badge.inner_text())
        assert "may shrink to 1 or grow to 4" in badge.get_attribute("title")
        shoot(page, "elastic-cluster.png")
        page.close()
    finally:
        live_platform.api("POST", f"/api/v1/jobs/{job['id']}/terminate/")
        live_platform.wait_for(job["id"])


def test_a_fixed_job_has_no_elastic_chart(browser, live_platform):
    job = live_platform.submit("failing")
    page = log_in(browser, live_platform.url, live_platform.username, live_platform.password)
    page.goto(f"{live_platform.url}/jobs/{job['id']}/")
    page.wait_for_selector(CONNECTED)
    assert page.locator(SECTION).count() == 0
    page.close()
