"""ui: how fast the dashboard shows what happens, measured in a real headless Chromium.

1. Log latency. A learner prints probe lines stamped with the wall clock; the job page (open and
   live) records when each line appears in the log's DOM. The baseline, measured on the same lines
   at the same time, is a script polling the REST log endpoint every 20 ms: the latency the
   platform adds before any page is involved (agent batching, ingest, database). Browser and
   learner share this machine's clock.
2. Job list at 100,000 jobs. The tenant gets 100,000 jobs; the browser loads the jobs page and
   reads the view's own time from its Server-Timing header (Navigation Timing API). The baseline
   is the same page for a tenant with 100 jobs, loaded in the same run.

Runs on the embedded defaults (SQLite + embedded Redis), like `overhead`.
"""
import os
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

from bench.report import median, percentile, publish
from bench.targets import shown
from tests.support import browser as chromium
from tests.support.harness import start_session

PROBE_LINES = int(os.environ.get("BENCH_UI_PROBE_LINES", 80))
PROBE_INTERVAL_S = 0.2
LOGIN_TIMEOUT_MS = 120_000
LIST_JOBS = int(os.environ.get("BENCH_UI_LIST_JOBS", 100_000))
BASELINE_JOBS = 100
LIST_LOADS = int(os.environ.get("BENCH_UI_LIST_LOADS", 15))
PROBE_JOB = f"""
name: log-probe
cpus: 0.5
memory: 256MiB
framework:
  name: custom
  command: |
    python3 -c "import time
    time.sleep(4)
    for i in range({PROBE_LINES}):
        print(f'probe {{i}} {{time.time() * 1000:.1f}}', flush=True)
        time.sleep({PROBE_INTERVAL_S})"
"""
PROBE = re.compile(r"^probe (\d+) ([\d.]+)$")
# Stamps each probe line with the moment it enters the log's DOM.
WATCH_LOG = """() => {
  window.__shown = {};
  const rows = document.querySelector('.log-rows');
  new MutationObserver(() => {
    const now = Date.now();
    for (const el of rows.querySelectorAll('.lt')) {
      const m = /^probe (\\d+) /.exec(el.textContent);
      if (m && !(m[1] in window.__shown)) window.__shown[m[1]] = now;
    }
  }).observe(rows, { childList: true, subtree: true });
}"""
SERVER_TIME = """() => {
  const nav = performance.getEntriesByType('navigation')[0];
  const view = nav.serverTiming.find(t => t.name === 'view');
  return { view: view ? view.duration : null, ttfb: nav.responseStart - nav.requestStart,
           load: nav.loadEventEnd - nav.startTime };
}"""


def printed_at(lines):
    """{probe index: ms since the epoch when the learner printed it}."""
    stamps = {}
    for line in lines:
        if m := PROBE.match(line["line"]):
            stamps[m.group(1)] = float(m.group(2))
    return stamps


def poll_rest(session, job_id, seen, stop):
    """The baseline: when each probe line first comes back from GET /logs/?since=, polled every 20 ms."""
    since = 0
    while not stop.is_set():
        page = session.api("GET", f"/api/v1/jobs/{job_id}/logs/", params={"since": since}).json()
        now = time.time() * 1000
        for line in page["results"]:
            if m := PROBE.match(line["line"]):
                seen.setdefault(m.group(1), now)
        since = page["next_since"]
        if page["final"] and not page["results"]:
            return
        time.sleep(0.02)


def log_latency(session, browser):
    page = chromium.log_in(browser, session.url, session.username, session.password, timeout_ms=LOGIN_TIMEOUT_MS)
    job = session.submit("custom-shell", manifest_text=PROBE_JOB)
    page.goto(f"{session.url}/jobs/{job['id']}/")
    page.evaluate(WATCH_LOG)
    page.wait_for_selector("[data-testid=connection][data-state=live]")
    live_since = time.time() * 1000
    rest_seen, stop = {}, threading.Event()
    poller = threading.Thread(target=poll_rest, args=(session, job["id"], rest_seen, stop), daemon=True)
    poller.start()
    done = session.wait_for(job["id"], timeout=300)
    page.wait_for_function(f"() => Object.keys(window.__shown).length >= {PROBE_LINES}", timeout=30_000)
    stop.set()
    poller.join(timeout=10)
    if done["status"] != "COMPLETED":
        raise RuntimeError(f"probe job {job['id']} ended {done['status']}: {done['status_reason']}")
    printed = printed_at(session.all_logs(job["id"]))
    shown = page.evaluate("window.__shown")
    page.close()
    # Lines printed before the page was live arrive as backlog: that measures page load, not live updates.
    live = [i for i, t in printed.items() if t > live_since]
    browser_ms = [shown[i] - printed[i] for i in live if i in shown]
    rest_ms = [rest_seen[i] - printed[i] for i in live if i in rest_seen]
    return browser_ms, rest_ms


def add_jobs(session, *, tenant, username, count):
    """Insert `count` finished jobs straight into the platform's database (the bench runs Django
    against the same database the platform uses)."""
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from jobs.models import Job
    from tenants.models import Tenant
    tenant_row = Tenant.objects.get(slug=tenant)
    owner = get_user_model().objects.get(username=username)
    statuses = ["COMPLETED", "FAILED", "TERMINATED", "COMPLETED", "HALTED"]
    frameworks = ["pytorch", "tensorflow", "jax", "sklearn", "custom"]
    now = timezone.now()
    batch = []
    for i in range(count):
        created = now - timedelta(days=30, seconds=count - i)
        batch.append(Job(tenant=tenant_row, owner=owner, name=f"sweep-{i:06d}", framework=frameworks[i % 5],
                         manifest={}, manifest_yaml="", memory_bytes=2**30, code_sha256="0" * 64,
                         status=statuses[i % 5], created_at=created, started_at=created,
                         finished_at=created + timedelta(minutes=i % 90)))
        if len(batch) == 5000:
            Job.objects.bulk_create(batch)
            batch = []
    Job.objects.bulk_create(batch)


def list_loads(page, url):
    page.goto(url)  # warm: first use of the connection, templates, caches
    timings = []
    for _ in range(LIST_LOADS):
        page.goto(url)
        page.wait_for_selector("[data-testid=jobs-table]")
        timings.append(page.evaluate(SERVER_TIME))
    return timings


def job_list_times(session, browser):
    os.environ["DATABASE_URL"] = session.env["DATABASE_URL"]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django
    django.setup()
    session.manage("tenant", "create", "bench-small")
    session.manage("tenant", "adduser", "bench-small", "small", "--role", "researcher", "--password=small-password")
    started = time.monotonic()

    def insert():  # in a thread: Django refuses database calls from playwright's event-loop thread
        add_jobs(session, tenant=session.tenant, username=session.username, count=LIST_JOBS)
        add_jobs(session, tenant="bench-small", username="small", count=BASELINE_JOBS)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(insert).result()
    insert_s = time.monotonic() - started
    big = chromium.log_in(browser, session.url, session.username, session.password, timeout_ms=LOGIN_TIMEOUT_MS)
    small = chromium.log_in(browser, session.url, "small", "small-password", timeout_ms=LOGIN_TIMEOUT_MS)
    results = {
        "big": list_loads(big, session.url + "/"),
        "small": list_loads(small, session.url + "/"),
        "big_filtered": list_loads(big, session.url + "/?status=FAILED&framework=tensorflow"),
    }
    # Deep in the list: follow "Older" 20 times (keyset pages), then time that page.
    big.goto(session.url + "/")
    for _ in range(20):
        big.goto(session.url + big.get_attribute("[data-testid=page-older]", "href"))
    results["big_deep"] = list_loads(big, big.url)
    big.close()
    small.close()
    return results, insert_s


def main():
    from playwright.sync_api import sync_playwright
    if not chromium.chromium_found():
        raise SystemExit(f"bench ui needs Chromium at {chromium.CHROMIUM} (apt-get install chromium, or set "
                         "TRAINYARD_CHROMIUM)")
    data_dir = Path(tempfile.mkdtemp(prefix="trainyard-bench-ui-"))
    env_backup = {k: os.environ.pop(k) for k in ("DATABASE_URL", "REDIS_URL") if k in os.environ}
    session = start_session(data_dir)  # the embedded defaults: SQLite + embedded Redis
    try:
        with sync_playwright() as playwright:
            browser = chromium.launch(playwright)
            try:
                browser_ms, rest_ms = log_latency(session, browser)
                lists, insert_s = job_list_times(session, browser)
            finally:
                browser.close()
    finally:
        session.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
        os.environ.update(env_backup)

    def views(key):
        return [t["view"] for t in lists[key]]

    figures = {
        "first_log_line_p95_ms": round(percentile(browser_ms, 0.95), 1),
        "first_log_line_p50_ms": round(percentile(browser_ms, 0.5), 1),
        "first_log_line_baseline_rest_poll_p95_ms": round(percentile(rest_ms, 0.95), 1),
        "first_log_line_baseline_rest_poll_p50_ms": round(percentile(rest_ms, 0.5), 1),
        "first_log_line_ratio_vs_rest_poll": round(percentile(browser_ms, 0.95) / percentile(rest_ms, 0.95), 3),
        "log_lines_measured": len(browser_ms),
        "job_list_100k_server_ms": round(median(views("big")), 1),
        "job_list_100k_server_p95_ms": round(percentile(views("big"), 0.95), 1),
        "job_list_baseline_100_jobs_server_ms": round(median(views("small")), 1),
        "job_list_100k_ratio_vs_100_jobs": round(median(views("big")) / median(views("small")), 3),
        "job_list_100k_filtered_server_ms": round(median(views("big_filtered")), 1),
        "job_list_100k_page_21_server_ms": round(median(views("big_deep")), 1),
        "job_list_100k_browser_load_ms": round(median([t["load"] for t in lists["big"]]), 1),
        "list_jobs": LIST_JOBS,
        "list_loads": LIST_LOADS,
        "insert_100k_s": round(insert_s, 1),
    }
    publish("ui", [
        ("log line printed → shown in the browser, p95 (ms)", figures["first_log_line_p95_ms"], shown("ui", "first_log_line_p95_ms")),
        ("log line printed → shown in the browser, p50 (ms)", figures["first_log_line_p50_ms"], ""),
        ("baseline: printed → returned by REST poll, p95 (ms)",
         figures["first_log_line_baseline_rest_poll_p95_ms"], ""),
        ("ratio browser / REST poll (p95)", figures["first_log_line_ratio_vs_rest_poll"], ""),
        (f"jobs page, {LIST_JOBS:,} jobs: view time median (ms)", figures["job_list_100k_server_ms"],
         shown("ui", "job_list_100k_server_ms")),
        (f"jobs page, {LIST_JOBS:,} jobs: view time p95 (ms)", figures["job_list_100k_server_p95_ms"], ""),
        (f"baseline: jobs page, {BASELINE_JOBS} jobs: view time (ms)",
         figures["job_list_baseline_100_jobs_server_ms"], ""),
        ("ratio 100k / 100 jobs", figures["job_list_100k_ratio_vs_100_jobs"], ""),
        ("jobs page filtered (status+framework), view time (ms)", figures["job_list_100k_filtered_server_ms"], ""),
        ("jobs page 21 (keyset), view time (ms)", figures["job_list_100k_page_21_server_ms"], ""),
        ("jobs page full browser load (ms)", figures["job_list_100k_browser_load_ms"], ""),
    ], figures)
