"""Records that cannot stop a job (issue 40): one bad ingest record is refused by name while the rest
of its batch is stored and the job goes on; an artifact's name is the same when recorded, listed and
downloaded.

The findings: a metric with `"step": 1e300` made every ingest post of its learner fail with a server
error (OverflowError), so no more of its log was stored and the job stayed PROCESSING; an artifact
named with a newline was recorded but could not be downloaded.
"""
import json
import os

import requests

from portal.runner import PROJECT_ROOT
from tests.support.harness import EXAMPLES

RECORDS = PROJECT_ROOT / "tests" / "security" / "jobs" / "records"


def submit(platform, mode):
    manifest = (RECORDS / "manifest.yml").read_text().replace("records.py metrics", f"records.py {mode}")
    return platform.submit(os.path.relpath(RECORDS, EXAMPLES), manifest_text=manifest)


def lines(platform, job_id):
    return [line["line"] for line in platform.all_logs(job_id)]


def wait_for_line(platform, job_id, text, timeout=60):
    import time
    deadline = time.monotonic() + timeout
    while text not in lines(platform, job_id):
        assert time.monotonic() < deadline, f"no {text!r} in {job_id}'s log: {lines(platform, job_id)[-5:]}"
        assert platform.job(job_id)["status"] not in ("COMPLETED", "FAILED", "TERMINATED")
        time.sleep(0.2)


def test_a_learner_reporting_a_step_beyond_int64_completes_with_its_good_points(platform):
    job = submit(platform, "metrics")
    done = platform.wait_for(job["id"], timeout=60)
    assert done["status"] == "COMPLETED", done.get("status_reason")
    points = platform.api("GET", f"/api/v1/jobs/{job['id']}/metrics/").json()["results"]
    assert [(p["step"], p["value"]) for p in points] == [(1, 0.5), (2, 0.3)]
    assert "records: done" in lines(platform, job["id"])


def test_a_post_with_a_step_beyond_int64_stores_the_rest_and_names_it(platform):
    job = submit(platform, "wait")
    wait_for_line(platform, job["id"], "records: waiting")
    folder = platform.data_dir / "storage" / platform.tenant / job["id"]
    config = json.loads((folder / "attempt-1" / "learner-0" / "agent.json").read_text())

    def post(records):
        return requests.post(config["ingest_url"], json={"attempt": 1, "learner": 0, "records": records},
                             headers={"Authorization": f"Ingest {config['ingest_token']}"}, timeout=30)

    acked = post([]).json()["acked"]  # how far the learner's agent got
    now = 1763726400.0
    response = post([
        {"seq": acked + 1, "kind": "log", "stream": "stdout", "line": "posted: before", "time": now},
        {"seq": acked + 2, "kind": "metric", "name": "loss", "value": 0.4, "step": 1e300, "time": now},
        {"seq": acked + 3, "kind": "metric", "name": "loss", "value": 0.25, "step": 5, "time": now},
        {"seq": acked + 4, "kind": "log", "stream": "stdout", "line": "posted: after", "time": now}])
    assert response.status_code == 200, response.text[:300]
    assert response.json() == {"acked": acked + 4, "rejected": [
        {"seq": acked + 2, "error": "step: must be null or an integer between -2**63 and 2**63-1"}]}
    later = post([{"seq": acked + 5, "kind": "log", "stream": "stdout", "line": "posted: later", "time": now}])
    assert later.status_code == 200 and later.json() == {"acked": acked + 5}

    (folder / "results" / "go").write_text("5")  # the learner goes on: its next 5 lines are resends now
    done = platform.wait_for(job["id"], timeout=60)
    assert done["status"] == "COMPLETED", done.get("status_reason")
    log = lines(platform, job["id"])
    assert {"posted: before", "posted: after", "posted: later", "records: done"} <= set(log)
    assert any(line.startswith("ingest: 1 record(s) of learner 0 refused") and "step: must be" in line for line in log)
    points = platform.api("GET", f"/api/v1/jobs/{job['id']}/metrics/").json()["results"]
    assert [(p["step"], p["value"]) for p in points] == [(5, 0.25)]


def test_every_recorded_artifact_downloads_under_its_own_name(platform):
    job = submit(platform, "artifacts")
    done = platform.wait_for(job["id"], timeout=60)
    assert done["status"] == "COMPLETED", done.get("status_reason")
    listed = platform.api("GET", f"/api/v1/jobs/{job['id']}/artifacts/").json()["results"]
    results = {a["name"]: a for a in listed if a["kind"] == "result"}
    for name, artifact in results.items():
        response = platform.api("GET", artifact["url"])
        assert response.status_code == 200, (name, response.status_code)
        assert response.text == f"content of {name.split('/', 1)[1]!r}\n"
        assert "\n" not in response.headers["Content-Disposition"]
    assert sorted(results) == ["results/good.txt", "results/odd #1?.txt"]
    assert any("not recorded because of their names ('results/bad\\nname.txt'" in line
               for line in lines(platform, job["id"]))
