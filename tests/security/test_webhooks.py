"""Webhooks cannot hold the platform, nor speak for a tenant (issue 40).

The findings: a receiver sending one byte a second held a worker as long as it liked (the timeout
was per read), and with two such hooks another tenant's trivial job sat in PENDING for 15 minutes
instead of 1.3 s; job names and log lines reached Slack-format hooks unescaped (`<!channel>`, links).

The receivers are real HTTP servers in this process (tests.support.webhook_receiver); the security
platform lets hooks reach 127.0.0.1 (TRAINYARD_WEBHOOK_ALLOW_PRIVATE, tests/security/conftest.py) and
gives each delivery TRAINYARD_WEBHOOK_TIMEOUT_S=5 s in all.
"""
import os
import threading
import time

import pytest

from notifications import delivery
from tests.support.harness import EXAMPLES
from tests.support.webhook_receiver import Receiver

pytestmark = pytest.mark.e2e

DEADLINE_S = 5  # TRAINYARD_WEBHOOK_TIMEOUT_S of the security platform
HOSTILE = os.path.relpath(EXAMPLES.parent / "tests" / "security" / "jobs" / "hostile", EXAMPLES)


def quick_job(platform, *, token=None, name="quick", command="echo one; echo two"):
    manifest = (f"name: {name!r}\nlearners: 1\ngpus: 0\ncpus: 0.5\nmemory: 256MiB\n"
                f"framework:\n  name: custom\n  command: {command}\n")
    return platform.submit(HOSTILE, manifest_text=manifest, token=token)


def add_hook(platform, url, *, token=None):
    response = platform.api("POST", "/api/v1/webhooks/", token=token, json={"url": url, "format": "slack"})
    assert response.status_code == 201, response.text
    return response.json()


def remove_hook(platform, hook, *, token=None):
    platform.api("DELETE", f"/api/v1/webhooks/{hook['id']}/", token=token)


def test_a_trickling_receiver_is_cut_off_at_the_deadline():
    """One delivery to a receiver that answers one byte a second ends within its deadline."""
    trickler = Receiver(trickle_s=1.0).start()
    ended = []

    def deliver():
        began = time.monotonic()
        try:
            delivery.post(trickler.url, b"{}", {}, secret="s", policy=_private_allowed(), timeout_s=DEADLINE_S)
        except delivery.DeliveryFailed as exc:
            ended.append((str(exc), time.monotonic() - began))

    try:
        sender = threading.Thread(target=deliver, daemon=True)
        sender.start()
        sender.join(DEADLINE_S + 10)
        assert not sender.is_alive(), "the delivery still waits on a receiver that sends one byte a second"
        [(error, took)] = ended
        assert "timed out" in error and DEADLINE_S - 0.2 < took < DEADLINE_S + 2
    finally:
        trickler.stop()


def _private_allowed():
    from jobs.egress import EgressPolicy
    return EgressPolicy(allow_private=True)


def test_trickling_receivers_of_one_tenant_do_not_hold_another_tenants_job(platform, intruder):
    _, _, mallory = intruder
    tricklers = [Receiver(trickle_s=1.0).start() for _ in range(2)]
    hooks = [add_hook(platform, t.url, token=mallory) for t in tricklers]
    try:
        # Mallory's job changes status a few times: every change is a delivery to each slow hook.
        noisy = [quick_job(platform, token=mallory, name=f"noisy-{i}") for i in range(2)]
        deadline = time.monotonic() + 30
        # A delivery is trickling: mallory's tenant holds its one delivery at a time
        # (notifications.services.DELIVERING_PER_TENANT). Both at once happens only in the moment a
        # receiver takes to notice the hang-up of the one before, which a wait for both missed now and then.
        while not any(t.trickling for t in tricklers):
            assert time.monotonic() < deadline, "the hooks were never called"
            time.sleep(0.1)
        began = time.monotonic()
        job = quick_job(platform, name="alice-quick")
        done = platform.wait_for(job["id"], timeout=60)
        took = time.monotonic() - began
        assert done["status"] == "COMPLETED", done.get("status_reason")
        assert took < 20, f"alice's two-line job took {took:.1f}s while mallory's hooks trickled"
        for job_of_mallory in noisy:
            platform.wait_for(job_of_mallory["id"], token=mallory, timeout=60)
        # And each delivery was cut off at its deadline, not left to trickle on (the receiver sees
        # the hang-up at its next byte).
        time.sleep(DEADLINE_S + 2)
        trickled = [seconds for t in tricklers for seconds in t.trickled]
        assert trickled and max(trickled) < DEADLINE_S + 3, trickled
        # On a worker of their own: the lifecycle worker never ran one (portal.runner's `webhooks`).
        logs = platform.platform.log_dir
        ran = "Task jobs.tasks.deliver_webhook["  # each received task's line (the banner lists every task)
        assert ran in (logs / "webhooks.log").read_text()
        assert ran not in (logs / "worker.log").read_text()
    finally:
        for hook in hooks:
            remove_hook(platform, hook, token=mallory)
        for trickler in tricklers:
            trickler.stop()


def test_hanging_receivers_of_two_tenants_do_not_delay_a_third_tenants_delivery(platform, intruder):
    """Each tenant sends one delivery at a time, so two tenants with hanging receivers hold two of the
    webhooks' worker's threads, and alice's delivery goes out beside them, not after their deadlines."""
    _, _, mallory = intruder
    oscar = platform.add_member("team-c", "oscar")
    tricklers = [Receiver(trickle_s=1.0).start() for _ in range(2)]
    hooks = [(add_hook(platform, t.url, token=token), token) for t, token in zip(tricklers, (mallory, oscar))]
    receiver = Receiver().start()
    hooks.append((add_hook(platform, receiver.url), None))
    try:
        noisy = [quick_job(platform, token=token, name=f"noisy-{i}") for i, token in enumerate((mallory, oscar))]
        deadline = time.monotonic() + 30
        while not all(t.trickling for t in tricklers):
            assert time.monotonic() < deadline, f"the hooks were never both called: {[t.trickling for t in tricklers]}"
            time.sleep(0.05)
        job = quick_job(platform, name="alice-beside")
        began = time.monotonic()
        while not any(payload["job"]["id"] == job["id"] for payload, _ in receiver.events(hooks[-1][0]["secret"])):
            assert time.monotonic() - began < 30, "alice's hook heard nothing of her job"
            time.sleep(0.05)
        took = time.monotonic() - began
        # Waiting for a thread, it would have gone out when the first hanging delivery was cut off, most
        # of DEADLINE_S after this began.
        assert took < DEADLINE_S - 2, (f"alice's first delivery took {took:.1f}s while two other tenants' "
                                       f"receivers hung (a delivery's deadline is {DEADLINE_S}s)")
        for job_of_neighbour, token in zip(noisy, (mallory, oscar)):
            platform.wait_for(job_of_neighbour["id"], token=token, timeout=60)
    finally:
        for hook, token in hooks:
            remove_hook(platform, hook, token=token)
        for server in (*tricklers, receiver):
            server.stop()


def test_a_slack_hook_gets_a_hostile_job_name_as_text(platform):
    receiver = Receiver().start()
    hook = add_hook(platform, receiver.url)
    try:
        name = "<!channel> <http://evil.example|click here> & @here"
        job = quick_job(platform, name=name)
        platform.wait_for(job["id"], timeout=60)
        deadline = time.monotonic() + 30
        while True:
            events = receiver.events(hook["secret"])
            texts = [payload["text"] for payload, _ in events if payload["job"]["id"] == job["id"]]
            if any(" is COMPLETED" in t for t in texts):
                break
            assert time.monotonic() < deadline, f"no COMPLETED event: {texts}"
            time.sleep(0.2)
        for text in texts:
            assert "<" not in text and ">" not in text, text
            assert text.startswith("Trainyard job &lt;!channel&gt; &lt;http://evil.example|click here&gt; &amp; "
                                   "@\u2060here (")
        assert all(payload["job"]["name"] == name for payload, _ in events)  # the data itself is unchanged
    finally:
        remove_hook(platform, hook)
        receiver.stop()
