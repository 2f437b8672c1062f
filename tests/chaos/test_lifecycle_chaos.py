"""Chaos for the lifecycle's follow-up work (jobs.outbox) and its runtime fields (jobs.runtime).

- The worker is stopped, the lifecycle's messages for a job's teardown or finish are dropped from the
  broker (its Redis queue flushed), the worker starts again: everything is still torn down and stored,
  because the work is a row in the database and the reconcile pass sends it again.
- The job's stored manifest stops parsing while the job runs (a rule tightened, an edit): the job
  still completes, because later steps read the runtime fields stored at submission.
"""
import json
import random
import time

import pytest
import redis

from tests.chaos.invariants import WORKLOAD, check_job, check_no_agent_left, check_usage_released, submit
from trainyard.packing import code_upload

pytestmark = [pytest.mark.chaos, pytest.mark.e2e]
# A learner that prints nothing: its agent never posts, so never hears a 410 that would make it stop
# its learner by itself. Only a teardown ends it.
SILENT = 'name: chaos-silent\ncpus: 0.5\nmemory: 256MiB\nframework: {name: custom, command: "sleep 300"}\n'


def stop_worker(chaos):
    chaos.platform.kill("worker")


def drop_broker_messages(chaos, *, expect_one_within=0.0):
    """Drop every message waiting in the broker: the queue and the unacknowledged ones (Celery's keys
    in the platform's own Redis database; channel-layer and cache keys stay). `expect_one_within`:
    seconds to wait for a message first (a web request's messages leave from its process's sending
    thread, after the response)."""
    client = redis.Redis.from_url(chaos.platform.env["REDIS_URL"])
    deadline = time.monotonic() + expect_one_within
    while not (dropped := client.llen("celery") + client.hlen("unacked")) and time.monotonic() < deadline:
        time.sleep(0.05)
    client.delete("celery", "unacked", "unacked_index")
    return dropped


def open_follow_ups(chaos, job_id):
    return json.loads(chaos.session.manage("shell", "-v", "0", "-c", (
        "import json; from jobs.models import FollowUp; "
        f"print(json.dumps(list(FollowUp.objects.filter(job_id={job_id!r}, done_at=None)"
        ".values_list('kind', 'attempt', 'tries', 'last_error'))))")))


def check_follow_ups_done(chaos, job_id, context, timeout=30):
    deadline = time.monotonic() + timeout
    while (left := open_follow_ups(chaos, job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"{context}: follow-up work of {job_id} still open: {left}"


def learner_states(chaos, job_id):
    return json.loads(chaos.session.manage("shell", "-v", "0", "-c", (
        "import json; from jobs.models import Learner; "
        f"print(json.dumps(list(Learner.objects.filter(job_id={job_id!r}).values_list('state', flat=True))))")))


def submit_silent(chaos):
    code = code_upload(str(WORKLOAD))
    with code.fileobj:
        response = chaos.api("POST", "/api/v1/jobs/", files={
            "manifest": ("manifest.yml", SILENT), "code": (code.filename, code.fileobj.read())})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def test_a_teardown_whose_message_was_dropped_still_happens(chaos, seed):
    delay = random.Random(f"teardown:{seed}").uniform(0.2, 2.0)
    context = f"teardown seed {seed}: worker stopped {delay:.2f}s into PROCESSING, terminated, broker flushed"
    job_id = submit_silent(chaos)
    chaos.wait_for(job_id, {"PROCESSING"}, timeout=30)
    time.sleep(delay)
    stop_worker(chaos)
    response = chaos.api("POST", f"/api/v1/jobs/{job_id}/terminate/")
    assert response.status_code == 202, response.text
    assert drop_broker_messages(chaos, expect_one_within=10) >= 1, (
        f"{context}: the teardown's message never reached the broker")
    chaos.ensure_running()
    assert chaos.job(job_id)["status"] == "TERMINATED"
    check_no_agent_left(chaos, job_id, context, timeout=30)
    check_follow_ups_done(chaos, job_id, context)
    check_usage_released(chaos, context)


def test_a_finish_whose_message_was_dropped_still_stores_everything(chaos, seed):
    context = f"finish seed {seed}: worker stopped while PROCESSING, broker flushed once the learner exited"
    job_id, _ = submit(chaos)
    chaos.wait_for(job_id, {"PROCESSING"}, timeout=30)
    time.sleep(random.Random(f"finish:{seed}").uniform(0.2, 2.0))
    stop_worker(chaos)
    deadline = time.monotonic() + 30
    while learner_states(chaos, job_id) != ["exited"]:  # its exit is in the database, its finish in the broker
        assert time.monotonic() < deadline, f"{context}: the learner did not exit"
        time.sleep(0.5)
    drop_broker_messages(chaos)
    chaos.ensure_running()
    check_job(chaos, job_id, status="COMPLETED", attempts={1: "complete"}, context=context)
    check_follow_ups_done(chaos, job_id, context)


def test_a_job_completes_after_its_stored_manifest_stopped_parsing(chaos):
    context = "manifest edited to invalid YAML while the job ran"
    job_id, _ = submit(chaos)
    chaos.wait_for(job_id, {"PROCESSING"}, timeout=30)
    chaos.session.manage("shell", "-v", "0", "-c", (
        "from jobs.models import Job; "
        f"assert Job.objects.filter(pk={job_id!r}).update(manifest_yaml='framework: [no longer parses') == 1"))
    check_job(chaos, job_id, status="COMPLETED", attempts={1: "complete"}, context=context)
    check_follow_ups_done(chaos, job_id, context)

