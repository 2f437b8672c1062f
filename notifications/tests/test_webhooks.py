"""Webhooks: rows written with the status change for the hooks that may see the job, signed POSTs to
a real receiver on 127.0.0.1, failures kept and retried, slow receivers cut off, and the API's checks."""
import socket
import threading
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.models import Status
from jobs.states import transition
from notifications import delivery, services
from notifications.models import Delivery, Webhook
from tenants.models import AuditEntry
from tests.support.builders import client_for, job, logged_in, member, record_sends
from tests.support.webhook_receiver import Receiver

pytestmark = pytest.mark.django_db


@pytest.fixture
def sent(monkeypatch):
    return record_sends(monkeypatch)


@pytest.fixture
def private_allowed(settings):
    settings.WEBHOOK_ALLOW_PRIVATE = True  # the receiver runs on 127.0.0.1


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


def hook(membership, url, **kwargs):
    return services.create(membership, url=url, **kwargs)


def test_it_writes_a_delivery_with_each_change_for_the_hooks_that_see_the_job(sent, private_allowed):
    alice, bob = member(username="alice"), member(username="bob")
    admin = member(username="root", role="admin")
    mine, _ = hook(alice, "http://127.0.0.1:9/a")
    bobs, _ = hook(bob, "http://127.0.0.1:9/b")
    tenants, _ = hook(admin, "http://127.0.0.1:9/t", scope="tenant")
    other_tenant, _ = hook(member("team-b", "eve"), "http://127.0.0.1:9/e")
    private = job(alice, private=True)
    transition(private.id, Status.PENDING, actor="t")
    assert set(Delivery.objects.values_list("webhook_id", flat=True)) == {mine.pk}  # private: owner only
    public = job(alice)
    transition(public.id, Status.PENDING, actor="t")
    assert set(Delivery.objects.filter(job=public).values_list("webhook_id", flat=True)) == {
        mine.pk, bobs.pk, tenants.pk}
    assert not Delivery.objects.filter(webhook=other_tenant).exists()
    rows = Delivery.objects.values_list("pk", flat=True)
    assert sorted(args[0] for name, args in sent if name == services.TASK) == sorted(rows)


def test_it_names_preemption_and_filters_events(sent, private_allowed):
    alice = member()
    only, _ = hook(alice, "http://127.0.0.1:9/a", events=["preempted", "COMPLETED"])
    target = job(alice, status="PROCESSING")
    transition(target.id, Status.HALTING, actor="scheduler", reason="preempted: for a higher priority job")
    transition(target.id, Status.HALTED, actor="t")
    assert list(Delivery.objects.filter(webhook=only).values_list("event", flat=True)) == ["PREEMPTED"]
    payload = Delivery.objects.get(webhook=only).payload
    assert payload["text"].startswith(f"Trainyard job {target.name} ({target.id}) was preempted")
    assert payload["job"]["previous_status"] == "PROCESSING" and payload["tenant"] == "team-a"


def test_it_delivers_signed_to_a_receiver(sent, private_allowed, receiver):
    alice = member()
    created, secret = hook(alice, receiver.url)
    target = job(alice)
    transition(target.id, Status.PENDING, actor="t")
    row = Delivery.objects.get()
    assert services.deliver(row.pk) is not None
    [(payload, headers)] = receiver.events(secret)  # the signature checks out
    assert payload["event"] == "PENDING" and payload["sequence"] == 1 and payload["job"]["id"] == target.id
    assert headers[delivery.DELIVERY_HEADER] == services.delivery_id(row.pk)
    row.refresh_from_db()
    assert row.done_at and row.response_status == 200
    headers_, body = receiver.received[0]
    assert not delivery.verify("whsec_wrong", headers_[delivery.TIMESTAMP_HEADER], body,
                               headers_[delivery.SIGNATURE_HEADER])


def test_it_keeps_a_failure_on_the_row_and_delivers_once_the_receiver_is_back(sent, private_allowed):
    with socket.socket() as probe:  # a port nobody listens on: connections are refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    alice = member()
    _, secret = hook(alice, f"http://127.0.0.1:{port}/hook")
    transition(job(alice).id, Status.PENDING, actor="t")
    row = Delivery.objects.get()
    assert services.deliver(row.pk) is None
    row.refresh_from_db()
    assert row.tries == 1 and row.done_at is None and "cannot be reached" in row.last_error
    assert row.due_at > timezone.now()  # backoff
    assert (services.TASK, (row.pk,)) in sent  # sent again after the backoff
    back = Receiver(port=port).start()
    try:
        Delivery.objects.filter(pk=row.pk).update(due_at=timezone.now() - timedelta(seconds=1))
        assert services.deliver(row.pk) is not None
        assert len(back.events(secret)) == 1
        assert services.deliver(row.pk) is None  # done: never sent twice
        assert len(back.events(secret)) == 1
    finally:
        back.stop()


def test_a_receivers_answer_is_kept_on_the_row_without_its_control_characters(sent, private_allowed):
    """A NUL in the receiver's answer (PostgreSQL stores none in text) made recording the failure fail:
    the row stayed claimed, with no error and no retry, until the claim's time ran out."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Hostile(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            answer = b"a\x00b\x1b[2Jcd"
            self.send_response(500)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        alice = member()
        hook(alice, f"http://127.0.0.1:{server.server_port}/hook")
        transition(job(alice).id, Status.PENDING, actor="t")
        row = Delivery.objects.get()
        assert services.deliver(row.pk) is None
        row.refresh_from_db()
        assert row.last_error.endswith("the receiver answered HTTP 500: a?b?[2Jcd") and not row.claimed_by
        assert row.tries == 1 and row.due_at > timezone.now() and (services.TASK, (row.pk,)) in sent
    finally:
        server.shutdown()


def test_it_cuts_off_a_slow_receiver(sent, private_allowed, settings):
    settings.WEBHOOK_TIMEOUT_S = 0.5
    slow = Receiver(delay_s=5).start()
    try:
        alice = member()
        hook(alice, slow.url)
        transition(job(alice).id, Status.PENDING, actor="t")
        row = Delivery.objects.get()
        began = time.monotonic()
        assert services.deliver(row.pk) is None
        assert time.monotonic() - began < 3
        row.refresh_from_db()
        assert "timed out" in row.last_error.lower() and row.done_at is None
    finally:
        slow.stop()


# --- the API -------------------------------------------------------------------------------------
@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/", "http://localhost/", "http://169.254.169.254/latest/",
                                 "http://10.0.0.5/", "http://[::1]/", "http://[::ffff:127.0.0.1]/"])
def test_it_refuses_internal_targets_naming_the_field(url, settings):
    settings.WEBHOOK_ALLOW_PRIVATE = False
    answer = client_for(member()).post("/api/v1/webhooks/", {"url": url}, format="json")
    assert answer.status_code == 400 and answer.json()["field"] == "url"
    assert "not allowed for webhooks" in answer.json()["detail"]
    assert not Webhook.objects.exists()


@pytest.mark.parametrize("url", ["ftp://example.com/", "file:///etc/passwd", "javascript:alert(1)", "",
                                 "http://user:pw@example.com/", "http://", "http://example.com:99999/"])
def test_it_refuses_bad_urls_and_schemes(url, private_allowed):
    answer = client_for(member()).post("/api/v1/webhooks/", {"url": url}, format="json")
    assert answer.status_code == 400 and answer.json()["field"] == "url"


def test_a_url_no_request_line_can_carry_is_refused_and_its_encoded_form_taken(private_allowed):
    import http.client
    with pytest.raises(UnicodeEncodeError):  # what every delivery to it would fail with
        http.client.HTTPConnection("127.0.0.1", 9).putrequest("POST", "/hooks/é")
    client = client_for(member())
    for url in ("http://127.0.0.1:9/hooks/é", "http://127.0.0.1:9/hooks?to=é"):
        answer = client.post("/api/v1/webhooks/", {"url": url}, format="json")
        assert answer.status_code == 400 and answer.json()["field"] == "url"
        assert "outside ASCII" in answer.json()["detail"]
    assert client.post("/api/v1/webhooks/", {"url": "http://127.0.0.1:9/hooks/%C3%A9"}, format="json").status_code == 201


def test_it_shows_the_secret_once_and_audits_changes(private_allowed):
    alice = member()
    client = client_for(alice)
    answer = client.post("/api/v1/webhooks/", {"url": "http://127.0.0.1:9/x", "events": ["FAILED"]}, format="json")
    assert answer.status_code == 201 and answer.json()["secret"].startswith("whsec_")
    assert "no-store" in answer["Cache-Control"]  # no browser or proxy keeps a copy of the secret
    hook_id = answer.json()["id"]
    assert "secret" not in client.get(f"/api/v1/webhooks/{hook_id}/").json()
    assert [h["id"] for h in client.get("/api/v1/webhooks/").json()["results"]] == [hook_id]
    assert client.delete(f"/api/v1/webhooks/{hook_id}/").status_code == 204
    assert list(AuditEntry.objects.filter(target_type="webhook").order_by("pk").values_list("action", "actor")) == [
        ("created", "alice"), ("deleted", "alice")]


def test_it_answers_404_for_hooks_the_caller_does_not_manage(private_allowed):
    alice, admin = member(username="alice"), member(username="root", role="admin")
    mine, _ = hook(alice, "http://127.0.0.1:9/a")
    tenants, _ = hook(admin, "http://127.0.0.1:9/t", scope="tenant")
    outsider = client_for(member("team-b", "eve", role="admin"))
    colleague = client_for(member(username="bob"))
    for client, hook_id in [(outsider, mine.pk), (outsider, tenants.pk), (colleague, mine.pk), (colleague, tenants.pk)]:
        for path in (f"/api/v1/webhooks/{hook_id}/", f"/api/v1/webhooks/{hook_id}/deliveries/"):
            assert client.get(path).status_code == 404
        assert client.delete(f"/api/v1/webhooks/{hook_id}/").status_code == 404
    assert Webhook.objects.count() == 2
    assert client_for(admin).get(f"/api/v1/webhooks/{tenants.pk}/deliveries/").status_code == 200


def test_it_lets_only_admins_add_tenant_hooks(private_allowed):
    answer = client_for(member()).post("/api/v1/webhooks/", {"url": "http://127.0.0.1:9/", "scope": "tenant"},
                                       format="json")
    assert answer.status_code == 403 and answer.json()["field"] == "scope"


# --- the settings page ---------------------------------------------------------------------------
def test_it_adds_shows_and_removes_hooks_on_the_settings_page(sent, private_allowed):
    alice = member()
    page = logged_in(alice)
    added = page.post("/account/webhooks/", {"action": "create", "url": "http://127.0.0.1:9/x", "events": ["FAILED"]})
    assert added.status_code == 200 and b"whsec_" in added.content  # the secret, this once
    assert "no-store" in added["Cache-Control"]
    hook_ = Webhook.objects.get()
    transition(job(alice, status="PROCESSING").id, Status.FAILED, actor="t")
    listing = page.get("/account/webhooks/").content.decode()
    assert "whsec_" not in listing and "http://127.0.0.1:9/x" in listing and "FAILED" in listing
    assert "pending" in listing  # the delivery log
    assert b"whsec_" not in logged_in(member(username="bob")).get("/account/webhooks/").content
    page.post("/account/webhooks/", {"action": "delete", "hook": hook_.pk})
    assert not Webhook.objects.exists()


def test_it_names_the_field_when_the_page_refuses_a_hook(settings):
    settings.WEBHOOK_ALLOW_PRIVATE = False
    answer = logged_in(member()).post("/account/webhooks/", {"action": "create", "url": "http://127.0.0.1/"},
                                      follow=True)
    assert "url: this address is not allowed for webhooks" in answer.content.decode()
    assert not Webhook.objects.exists()


def test_it_checks_the_address_again_at_every_connection(sent, settings, receiver):
    settings.WEBHOOK_ALLOW_PRIVATE = True
    alice = member()
    hook(alice, receiver.url)
    transition(job(alice).id, Status.PENDING, actor="t")
    settings.WEBHOOK_ALLOW_PRIVATE = False  # e.g. the name now resolves to an internal address
    row = Delivery.objects.get()
    assert services.deliver(row.pk) is None
    assert receiver.received == []
    row.refresh_from_db()
    assert "cannot be reached" in row.last_error


def test_a_receiver_trickling_its_answer_is_cut_off_at_the_deadline(private_allowed):
    # One byte a second arrives within any read timeout; only a deadline for the whole delivery ends it.
    trickler = Receiver(trickle_s=1.0).start()
    try:
        outcome = []

        def deliver():
            began = time.monotonic()
            try:
                delivery.post(trickler.url, b"{}", {}, secret="s", policy=services.egress_policy(), timeout_s=3)
            except delivery.DeliveryFailed as exc:
                outcome.append((str(exc), time.monotonic() - began))
        sender = threading.Thread(target=deliver, daemon=True)  # daemon: a delivery that never ends fails the test
        sender.start()
        sender.join(10)
        assert not sender.is_alive(), "the delivery still waits on a receiver that sends one byte a second"
        [(error, took)] = outcome
        assert error == "timed out: the receiver did not answer within 3s in all" and 2.9 < took < 4.5
        assert trickler.received  # it was reached, and answered, slowly
    finally:
        trickler.stop()


@pytest.mark.parametrize("raw, shown", [
    ("<!channel>", "&lt;!channel&gt;"), ("<http://evil.example|click here>", "&lt;http://evil.example|click here&gt;"),
    ("a & b", "a &amp; b"), ("&lt;", "&amp;lt;"), ("@channel @Here @all @everyone", "@\u2060channel @\u2060Here @\u2060all @\u2060everyone"),
    ("@channels and mail@example.com", "@channels and mail@example.com"), ("plain name", "plain name"),
])
def test_slack_text_shows_text_as_itself(raw, shown):
    assert services.slack_text(raw) == shown


def test_a_slack_hook_gets_the_jobs_name_and_reason_escaped_and_a_json_hook_gets_them_as_they_are(
        sent, private_allowed):
    alice = member()
    slack, _ = hook(alice, "http://127.0.0.1:9/s")
    plain, _ = hook(alice, "http://127.0.0.1:9/j", format="json")
    target = job(alice, name="<!channel> <http://evil.example|click>")
    transition(target.id, Status.FAILED, actor="t", reason="log: <!here> & <@U123>")
    text = Delivery.objects.get(webhook=slack).payload["text"]
    assert text == (f"Trainyard job &lt;!channel&gt; &lt;http://evil.example|click&gt; ({target.id}) is FAILED "
                    "(log: &lt;!here&gt; &amp; &lt;@U123&gt;)")
    assert "<" not in text and ">" not in text
    data = Delivery.objects.get(webhook=plain).payload
    assert "text" not in data and data["job"]["name"] == "<!channel> <http://evil.example|click>"


# --- a tenant's hooks cost it, not the others -----------------------------------------------------
def test_a_status_change_costs_the_same_queries_however_many_hooks_hear_of_it(sent, private_allowed):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    owner = member(username="owner")

    def queries_of_one_change():
        with CaptureQueriesContext(connection) as queries:
            transition(job(owner).id, Status.PENDING, actor="t")
        return len(queries)

    hook(owner, "http://127.0.0.1:9/one")
    one = queries_of_one_change()
    for index in range(12):
        hook(member(username=f"viewer{index}", role="viewer"), "http://127.0.0.1:9/v")
    assert queries_of_one_change() == one
    assert Delivery.objects.filter(job__status=Status.PENDING).count() == 1 + 13


def test_a_private_jobs_change_reaches_only_the_hooks_of_those_who_see_it(sent, private_allowed):
    from guardian.shortcuts import assign_perm
    owner, admin = member(username="owner"), member(username="root", role="admin")
    friend, stranger = member(username="friend"), member(username="stranger")
    hooks = {name: hook(m, f"http://127.0.0.1:9/{name}")[0]
             for name, m in [("owner", owner), ("admin", admin), ("friend", friend), ("stranger", stranger)]}
    tenants_hook, _ = hook(admin, "http://127.0.0.1:9/tenant", scope="tenant")
    secret_job = job(owner, private=True)
    assign_perm("jobs.view_job", friend.user, secret_job)
    friend_left = member(username="gone")
    gone_hook, _ = hook(friend_left, "http://127.0.0.1:9/gone")
    assign_perm("jobs.view_job", friend_left.user, secret_job)
    friend_left.delete()  # shared with them, but no longer a member
    transition(secret_job.id, Status.PENDING, actor="t")
    heard = set(Delivery.objects.values_list("webhook_id", flat=True))
    assert heard == {hooks["owner"].pk, hooks["admin"].pk, hooks["friend"].pk}
    assert not heard & {hooks["stranger"].pk, tenants_hook.pk, gone_hook.pk}


def test_a_disabled_accounts_hooks_hear_nothing(sent, private_allowed):
    alice, boss = member(username="alice"), member(username="boss", role="admin")
    alices, _ = hook(alice, "http://127.0.0.1:9/alice")
    bosses, _ = hook(boss, "http://127.0.0.1:9/boss")
    boss.user.is_active = False  # let go: no session, token or hook of theirs may reach the tenant now
    boss.user.save()
    transition(job(alice).id, Status.PENDING, actor="t")
    transition(job(alice, private=True).id, Status.PENDING, actor="t")
    assert set(Delivery.objects.values_list("webhook_id", flat=True)) == {alices.pk}
    assert not Delivery.objects.filter(webhook=bosses).exists()


def test_a_member_who_leaves_takes_their_hooks_with_them_and_frees_the_tenants_room(private_allowed, monkeypatch):
    from tenants import people
    monkeypatch.setattr(services, "MAX_HOOKS_PER_TENANT", 3)
    admin, leaver = member(username="root", role="admin"), member(username="leaver")
    for _ in range(3):
        hook(leaver, "http://127.0.0.1:9/x")
    elsewhere, _ = hook(member("team-b", "leaver"), "http://127.0.0.1:9/b")
    people.remove_member(leaver)
    # Nobody left in the tenant could remove them (an admin manages only their own and the tenant's).
    assert not Webhook.objects.filter(tenant=admin.tenant).exists()
    hook(admin, "http://127.0.0.1:9/t", scope="tenant")
    assert Webhook.objects.filter(pk=elsewhere.pk).exists()  # their hooks in other tenants stay


def test_a_tenant_has_a_limited_number_of_hooks(private_allowed, monkeypatch):
    monkeypatch.setattr(services, "MAX_HOOKS_PER_TENANT", 3)
    for name in ("a", "b", "c"):
        hook(member(username=name), "http://127.0.0.1:9/x")
    with pytest.raises(services.HookError, match="the most it may have"):
        hook(member(username="d"), "http://127.0.0.1:9/x")
    hook(member("team-b", "e"), "http://127.0.0.1:9/x")  # another tenant's room is its own


def test_a_delivery_waits_while_its_tenant_delivers_another_and_others_go_on(sent, private_allowed, receiver):
    from tenants import throttling
    alice, eve = member(username="alice"), member("team-b", "eve")
    hook(alice, receiver.url)
    hook(eve, receiver.url)
    transition(job(alice).id, Status.PENDING, actor="t")
    transition(job(eve).id, Status.PENDING, actor="t")
    alices, eves = Delivery.objects.get(job__tenant=alice.tenant), Delivery.objects.get(job__tenant=eve.tenant)
    sent.clear()
    with throttling.slot(services._delivering(), alice.tenant_id) as held:  # alice's tenant is delivering
        assert held
        services.deliver(alices.pk)
        services.deliver(eves.pk)
    alices.refresh_from_db()
    eves.refresh_from_db()
    assert (alices.tries, alices.done_at) == (0, None)  # not tried: sent again for later
    assert sent == [(services.TASK, (alices.pk,))]
    assert eves.done_at is not None and len(receiver.received) == 1
    services.deliver(alices.pk)  # the slot is free again
    alices.refresh_from_db()
    assert alices.done_at is not None and len(receiver.received) == 2


def test_a_hooks_deliveries_go_out_one_at_a_time_in_order(sent, private_allowed, receiver):
    alice = member()
    _, secret = hook(alice, receiver.url)
    target = job(alice)
    transition(target.id, Status.PENDING, actor="t")
    transition(target.id, Status.FAILED, actor="t")
    first, second = Delivery.objects.order_by("pk")
    sent.clear()
    assert services.deliver(second.pk) is None  # the earlier one goes first
    assert (Delivery.objects.get(pk=second.pk).tries, sent, receiver.received) == (0, [], [])
    services.deliver(first.pk)
    assert sent == [(services.TASK, (second.pk,))]  # the next one, once this one is done
    services.deliver(second.pk)
    assert [payload["job"]["status"] for payload, _ in receiver.events(secret)] == ["PENDING", "FAILED"]


def test_a_hooks_numbers_and_delivery_ids_say_nothing_of_other_tenants_events(sent, private_allowed, receiver):
    """`sequence` and X-Trainyard-Delivery were the platform-wide row id: the gap between two numbers a
    receiver got counted every other hook's events meanwhile, another tenant's included. A hook now
    numbers its own deliveries 1, 2, 3 at their first try (a retry keeps the number), and the
    delivery id is opaque, the same on every try."""
    alice, eve = member(username="alice"), member("team-b", "eve")
    mine, secret = hook(alice, "http://127.0.0.1:9/down")  # refused at first
    hook(eve, "http://127.0.0.1:9/e")
    ours = job(alice)
    transition(ours.id, Status.PENDING, actor="t")
    for _ in range(3):  # the other tenant's events in between
        transition(job(eve).id, Status.PENDING, actor="t")
    transition(ours.id, Status.FAILED, actor="t")
    first, second = Delivery.objects.filter(webhook=mine).order_by("pk")
    assert second.pk - first.pk == 4  # the row ids count the other tenant's events
    assert services.deliver(first.pk) is None  # refused: kept for another try
    first.refresh_from_db()
    assert (first.sequence, first.tries) == (1, 1)
    Webhook.objects.filter(pk=mine.pk).update(url=receiver.url)
    services.deliver(first.pk)
    services.deliver(second.pk)
    got = receiver.events(secret)
    assert [payload["sequence"] for payload, _ in got] == [1, 2]
    ids = [headers[delivery.DELIVERY_HEADER] for _, headers in got]
    assert ids == [services.delivery_id(first.pk), services.delivery_id(second.pk)] and len(ids[0]) == 32
    assert not set(ids) & {str(first.pk), str(second.pk)}
    log = client_for(alice).get(f"/api/v1/webhooks/{mine.pk}/deliveries/").json()["results"]
    assert sorted((row["sequence"], row["delivery_id"]) for row in log) == [(1, ids[0]), (2, ids[1])]
    assert "id" not in log[0]


def test_deliveries_waiting_behind_their_hooks_first_one_leave_the_sweep_to_other_tenants(
        sent, private_allowed, monkeypatch, receiver):
    from jobs import outbox
    monkeypatch.setattr("jobs.dispatch.backlog", lambda queue=None: 0)
    alice, eve = member(username="alice"), member("team-b", "eve")
    alices, _ = hook(alice, receiver.url)
    eves, _ = hook(eve, "http://127.0.0.1:9/up")
    long_ago = timezone.now() - timedelta(hours=1)
    alices_job = job(alice)
    first, *waiting = Delivery.objects.bulk_create([
        Delivery(webhook=alices, job=alices_job, event="PENDING", payload={}, created=long_ago, due_at=long_ago)
        for _ in range(600)])
    # The receiver was down: the first row failed, and waits for its next try.
    Delivery.objects.filter(pk=first.pk).update(tries=3, due_at=timezone.now() + timedelta(seconds=30))
    for row in waiting:  # the message each row's change sent: each finds the hook's first one still open
        assert services.deliver(row.pk) is None
    lost = Delivery.objects.create(webhook=eves, job=job(eve), event="PENDING", payload={},
                                   created=timezone.now() - timedelta(minutes=1),
                                   due_at=timezone.now() - timedelta(minutes=1))  # its message was lost
    sent.clear()
    swept = outbox.sweep()
    assert lost.pk in swept  # not left behind the other tenant's queue of rows that cannot go yet
    assert not set(swept) & {row.pk for row in waiting}
    services.deliver(first.pk)  # the receiver is back: the first goes, and the next is due again
    following = Delivery.objects.get(pk=waiting[0].pk)
    assert following.due_at < timezone.now() + timedelta(minutes=1) and (services.TASK, (following.pk,)) in sent


def test_a_hook_whose_receiver_is_down_keeps_its_first_and_newest_open_deliveries(sent, private_allowed,
                                                                                   monkeypatch, receiver):
    monkeypatch.setattr(services, "MAX_OPEN_PER_HOOK", 3)
    alice, bob = member(username="alice"), member(username="bob")
    down, _ = hook(alice, receiver.url)
    bobs, _ = hook(bob, "http://127.0.0.1:9/b", events=["COMPLETED"])
    target = job(alice)
    for status in (Status.PENDING, Status.DOWNLOADING, Status.PROCESSING, Status.STORING, Status.COMPLETED):
        transition(target.id, status, actor="t")
    rows = {row.event: row for row in Delivery.objects.filter(webhook=down)}
    open_events = set(Delivery.objects.filter(webhook=down, done_at=None).values_list("event", flat=True))
    assert open_events == {"PENDING", "STORING", "COMPLETED"}  # the one being tried, and the newest
    log = {row["event"]: row for row in client_for(alice).get(f"/api/v1/webhooks/{down.pk}/deliveries/").json()["results"]}
    assert log["DOWNLOADING"]["state"] == log["PROCESSING"]["state"] == "gave up"
    assert "more than 3 deliveries waited" in log["PROCESSING"]["last_error"]
    assert Delivery.objects.filter(webhook=bobs, done_at=None).count() == 1  # another hook's rows: its own
    sent.clear()
    services.deliver(rows["PENDING"].pk)  # the receiver is back: the next open one follows
    assert sent == [(services.TASK, (rows["STORING"].pk,))]


@pytest.mark.django_db(transaction=True)
def test_hooks_added_at_the_same_time_stay_within_the_limit(private_allowed):
    from django.db import connection
    if connection.vendor != "postgresql":
        pytest.skip("SQLite runs one writer at a time: no two requests count at once")
    alice = member()
    for _ in range(services.MAX_HOOKS_PER_OWNER - 1):
        hook(alice, "http://127.0.0.1:9/h")
    gate = threading.Barrier(6)

    def add():
        try:
            gate.wait()
            hook(alice, "http://127.0.0.1:9/h")
        except services.HookError:
            pass
        finally:
            connection.close()

    threads = [threading.Thread(target=add) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert Webhook.objects.filter(user=alice.user).count() == services.MAX_HOOKS_PER_OWNER


# --- what a request may hold ----------------------------------------------------------------------
def test_a_url_with_a_control_character_is_refused_by_name_on_the_api_and_the_page(settings):
    settings.WEBHOOK_ALLOW_PRIVATE = False
    alice = member()
    api = client_for(alice)
    for body in ({"url": "http://93.184.216.34/a\x00b"}, {"url": "http://93.184.216.34/a\nb"}):
        answer = api.post("/api/v1/webhooks/", body, format="multipart")
        assert answer.status_code == 400 and answer.json()["field"] == "url", answer.content
    answer = api.post("/api/v1/webhooks/", "url=http%3A%2F%2F93.184.216.34%2Fa%00b",
                      content_type="application/x-www-form-urlencoded")
    assert answer.status_code == 400 and answer.json()["field"] == "url"
    page = logged_in(alice)
    answer = page.post("/account/webhooks/", {"action": "create", "url": "http://93.184.216.34/a\x00b"}, follow=True)
    assert "url: the URL holds a control character" in answer.content.decode()  # a multipart form
    answer = page.post("/account/webhooks/", "action=create&url=http%3A%2F%2F93.184.216.34%2Fa%00b",
                       content_type="application/x-www-form-urlencoded")
    assert answer.status_code == 400 and answer.content == b"url: holds a NUL character"  # a url-encoded one
    assert not Webhook.objects.exists()


def test_the_page_takes_only_plain_digits_for_a_hook_to_remove(private_allowed):
    alice = member()
    hook(alice, "http://127.0.0.1:9/x")
    assert logged_in(alice).post("/account/webhooks/", {"action": "delete", "hook": "\u00b2"}).status_code == 302
    assert Webhook.objects.count() == 1


# --- the key they are sealed with ------------------------------------------------------------------
def test_hooks_keep_working_when_the_secret_key_is_rotated_with_the_old_one_kept_as_a_fallback(
        sent, private_allowed, receiver, settings):
    from cryptography.fernet import InvalidToken
    alice = member()
    added, secret = hook(alice, receiver.url)
    old = settings.SECRET_KEY
    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = "rotated-" + "k" * 50, [old]
    transition(job(alice).id, Status.PENDING, actor="t")
    services.deliver(Delivery.objects.get().pk)
    assert Delivery.objects.get().done_at is not None
    [(payload, _)] = receiver.events(secret)  # signed with the hook's secret, as before
    assert payload["event"] == "PENDING"
    settings.SECRET_KEY_FALLBACKS = []  # sealed again under the new key when it was used
    assert services.secret_of(Webhook.objects.get(pk=added.pk)) == secret
    settings.SECRET_KEY = "another-" + "k" * 50
    with pytest.raises(InvalidToken):
        services.secret_of(Webhook.objects.get(pk=added.pk))
