"""Webhooks through the real platform (tests.support.harness: web, Celery worker and beat, Redis): a
receiver on 127.0.0.1 sees every transition of a job once, signed, also when it refused connections
for a minute while the job ran. TRAINYARD_WEBHOOK_ALLOW_PRIVATE lets the hook reach the loopback."""
import time

import pytest

from tests.support.harness import start_session
from tests.support.webhook_receiver import Receiver

pytestmark = pytest.mark.e2e
DOWN_S = 60


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    session = start_session(tmp_path_factory.mktemp("webhooks"), TRAINYARD_RECONCILE_INTERVAL="2",
                            TRAINYARD_WEBHOOK_ALLOW_PRIVATE="1", TRAINYARD_WEBHOOK_TIMEOUT_S="5")
    try:
        yield session
    finally:
        session.stop()


def transitions(platform, job_id):
    # Changes of status, not the submission itself (its event has no from_status; no hook hears of it).
    events = platform.api("GET", f"/api/v1/jobs/{job_id}/events/").json()["results"]
    return [e["to_status"] for e in events if e["from_status"]]


def events_for(receiver, secret, job_id, count, timeout):
    """The job's events as received (signatures checked), once `count` have arrived or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while True:
        got = [(p, h) for p, h in receiver.events(secret) if p["job"]["id"] == job_id]
        if len(got) >= count or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def add_hook(platform, url):
    answer = platform.api("POST", "/api/v1/webhooks/", json={"url": url})
    assert answer.status_code == 201, answer.text
    return answer.json()


def assert_each_once_in_order(got, statuses):
    deliveries = [h["X-Trainyard-Delivery"] for _, h in got]
    assert len(set(deliveries)) == len(deliveries), "a delivery arrived twice"
    in_order = sorted((p for p, _ in got), key=lambda p: p["sequence"])
    assert [p["job"]["status"] for p in in_order] == statuses


def test_it_delivers_every_transition_once_signed(platform):
    receiver = Receiver().start()
    try:
        hook = add_hook(platform, receiver.url)
        job = platform.submit("failing")
        assert platform.wait_for(job["id"])["status"] == "FAILED"
        statuses = transitions(platform, job["id"])
        got = events_for(receiver, hook["secret"], job["id"], len(statuses), timeout=60)
        time.sleep(3)  # and nothing more comes (no duplicates from the sweep)
        got = events_for(receiver, hook["secret"], job["id"], len(statuses), timeout=0)
        assert_each_once_in_order(got, statuses)
        assert got[-1][0]["event"] == "FAILED" and got[-1][0]["text"].startswith("Trainyard job ")
    finally:
        receiver.stop()


def test_it_delivers_every_transition_once_after_the_receiver_was_down_a_minute(platform):
    receiver = Receiver().start()
    port = receiver.port
    receiver.stop()  # refuses connections from now on
    hook = add_hook(platform, receiver.url)
    down_since = time.monotonic()
    job = platform.submit("failing")
    assert platform.wait_for(job["id"])["status"] == "FAILED"
    statuses = transitions(platform, job["id"])
    log = platform.api("GET", f"/api/v1/webhooks/{hook['id']}/deliveries/").json()["results"]
    time.sleep(max(0.0, DOWN_S - (time.monotonic() - down_since)))
    log = platform.api("GET", f"/api/v1/webhooks/{hook['id']}/deliveries/").json()["results"]
    # The first is retried; the later ones wait their turn behind it, in order.
    first, *later = reversed(log)  # the log is newest first
    assert first["state"] == "retrying" and first["last_error"], log
    assert later and all(row["state"] == "pending" for row in later), log
    back = Receiver(port=port).start()
    try:
        began = time.monotonic()
        got = events_for(back, hook["secret"], job["id"], len(statuses), timeout=120)
        caught_up = time.monotonic() - began
        time.sleep(3)
        got = events_for(back, hook["secret"], job["id"], len(statuses), timeout=0)
        assert_each_once_in_order(got, statuses)
        print(f"caught up {caught_up:.1f}s after the receiver came back; tries:",
              [row["tries"] for row in platform.api("GET", f"/api/v1/webhooks/{hook['id']}/deliveries/").json()["results"]])
        assert all(row["state"] == "delivered" for row in
                   platform.api("GET", f"/api/v1/webhooks/{hook['id']}/deliveries/").json()["results"])
    finally:
        back.stop()
