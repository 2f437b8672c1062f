"""Webhooks: who may manage which, creating (URL checked, secret made and shown once) and removing
them with an audit entry, the delivery rows a job's status change writes, and doing one delivery.

A user's hook hears of the jobs its user may see in its tenant (jobs.tenancy.jobs_of: private jobs
only when theirs, shared with them, or when they are an admin); a tenant's hook hears of the
tenant's jobs that are not private. The payload names the job, its tenant and the change, nothing else.
"""
import base64
import hashlib
import json
import math
import re
import secrets
import socket
from datetime import timedelta
from urllib.parse import urlsplit

from django.conf import settings
from django.db import transaction
from django.db.models import Count, F, Q
from django.utils import timezone
from django.utils.crypto import salted_hmac

from jobs import dispatch, egress, outbox, tenancy, transfers
from jobs.models import Status
from notifications import delivery
from notifications.models import Delivery, Webhook
from tenants import audit, throttling
from tenants.models import Tenant

TASK = "deliver_webhook"  # notifications.tasks.deliver_webhook(row id), sent by name (jobs.dispatch)
PREEMPTED = "PREEMPTED"  # a job halted by the scheduler for another one (HALTING with a preemption reason)
GPUS_IDLE = "GPUS_IDLE"  # a running job's GPUs stayed below its tenant's idle-GPU policy (jobs.idle)
EVENTS = tuple([s.value for s in Status] + [PREEMPTED, GPUS_IDLE])
MAX_HOOKS_PER_OWNER = 20
MAX_HOOKS_PER_TENANT = 100  # every status change writes a row per hook, in the change's transaction
LOOKUP_TIMEOUT_S = 5  # resolving a new hook's host, inside the request that adds it
# Deliveries of one tenant going out at once. The webhooks' workers are few and a slow receiver holds
# one for the whole timeout: a tenant with many hooks to slow receivers must leave the others to the
# rest of the tenants. A delivery finding its tenant's slot taken goes back on the queue for later.
DELIVERING_PER_TENANT = 1
WAIT_FOR_SLOT_S = 3.0  # how much later a delivery finding its tenant's slot taken is tried again
MAX_TRIES = 20  # about 17 minutes of retries with the outbox's backoff (1, 2, 4 ... 60 s)
# A row waiting for an earlier one of its hook is sent when that one is done; the sweep sends it again
# only this long after it last found the earlier one open (in case that message is lost as well).
WAITING_SWEPT_AFTER = timedelta(hours=1)
# Open deliveries one hook keeps: past them the oldest waiting ones are skipped (marked "gave up"),
# so a receiver down for days costs a bounded number of rows and gets the newest events when back.
MAX_OPEN_PER_HOOK = 100


class HookError(Exception):
    def __init__(self, detail, *, field=None, status=400):
        super().__init__(detail)
        self.detail, self.field, self.status = detail, field, status


def egress_policy():
    """Where hooks may connect: public addresses, unless TRAINYARD_WEBHOOK_ALLOW_PRIVATE (its own
    switch, not the data stores': allowing an internal MinIO must not let every user aim hooks at
    internal services)."""
    return egress.EgressPolicy(allow_private=settings.WEBHOOK_ALLOW_PRIVATE)


# --- who may manage which ------------------------------------------------------------------------
def hooks_of(membership):
    """The hooks this member manages: their own in this tenant, and the tenant's when an admin."""
    own = Webhook.objects.filter(tenant=membership.tenant, user=membership.user)
    if membership.is_admin:
        return own | Webhook.objects.filter(tenant=membership.tenant, user=None)
    return own


def hook_or_404(membership, hook_id):
    from django.http import Http404
    hook = hooks_of(membership).filter(pk=hook_id).first()
    if hook is None:
        raise Http404(f"No webhook {hook_id}.")
    return hook


# --- creating and removing -----------------------------------------------------------------------
def check_url(url):
    """The URL as stored; HookError naming `url` when it is not an http(s) URL to an allowed address."""
    url = str(url or "").strip()
    if not url or len(url) > 2000:
        raise HookError("give an http:// or https:// URL of at most 2000 characters", field="url")
    if any(ord(c) < 32 or ord(c) == 127 for c in url):
        raise HookError("the URL holds a control character (NUL, a line break, ...)", field="url")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise HookError("not a valid URL", field="url") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HookError("only http:// and https:// URLs with a host name are allowed", field="url")
    if parts.username or parts.password:
        raise HookError("credentials in the URL are not allowed; the hook's secret signs every request",
                        field="url")
    if not (parts.path + parts.query + parts.fragment).isascii():  # no request line can carry it
        raise HookError("the URL's path or query holds a character outside ASCII; percent-encode it "
                        "(é is %C3%A9)", field="url")
    try:
        egress.checked_addresses(parts.hostname, port or (443 if parts.scheme == "https" else 80), egress_policy(),
                                 timeout=LOOKUP_TIMEOUT_S)
    except (egress.EndpointRefused, socket.error):
        raise HookError("this address is not allowed for webhooks on this platform (internal, private or "
                        "reserved addresses are refused) or it does not resolve", field="url") from None
    return url


def check_events(events):
    if events in (None, ""):
        return []
    if not isinstance(events, list) or not all(isinstance(e, str) for e in events):
        raise HookError("give a list of event names", field="events")
    unknown = sorted({e.upper() for e in events} - set(EVENTS))
    if unknown:
        raise HookError(f"unknown events {', '.join(unknown)}; known: {', '.join(EVENTS)}", field="events")
    return sorted({e.upper() for e in events})


def create(membership, *, url, events=None, format=Webhook.Format.SLACK, scope="user"):
    """A new hook and its secret (returned in clear this once)."""
    if scope not in ("user", "tenant"):
        raise HookError("scope is user or tenant", field="scope")
    if scope == "tenant" and not membership.is_admin:
        raise HookError("only the tenant's admins manage the tenant's webhooks", field="scope", status=403)
    if format not in Webhook.Format.values:
        raise HookError(f"format is one of {', '.join(Webhook.Format.values)}", field="format")
    url, events = check_url(url), check_events(events)
    user = membership.user if scope == "user" else None
    secret = "whsec_" + secrets.token_urlsafe(32)
    with transaction.atomic():
        # Counted under the tenant's row lock: requests at the same time cannot each find room for one more.
        Tenant.objects.select_for_update().filter(pk=membership.tenant_id).exists()
        hooks = Webhook.objects.filter(tenant=membership.tenant)
        if hooks.filter(user=user).count() >= MAX_HOOKS_PER_OWNER:
            raise HookError(f"at most {MAX_HOOKS_PER_OWNER} webhooks each", field="url")
        if hooks.count() >= MAX_HOOKS_PER_TENANT:
            raise HookError(f"the tenant has {MAX_HOOKS_PER_TENANT} webhooks, the most it may have", field="url")
        hook = Webhook.objects.create(tenant=membership.tenant, user=user, url=url, events=events, format=format,
                                      sealed_secret=_sealers()[0].encrypt(secret.encode()).decode(),
                                      created_by=membership.user.username)
        audit.record("created", "webhook", _label(hook), tenant=hook.tenant, after=describe(hook))
    return hook, secret


def remove(hook):
    with transaction.atomic():
        audit.record("deleted", "webhook", _label(hook), tenant=hook.tenant, before=describe(hook))
        hook.delete()


def on_membership_deleted(sender, instance, **kwargs):
    """post_delete of Membership, however it is deleted: the user's own hooks in that tenant go with
    them. Left behind they would fill the tenant's MAX_HOOKS_PER_TENANT, and no one in the tenant
    could remove them (an admin manages only their own hooks and the tenant's)."""
    for hook in Webhook.objects.filter(tenant_id=instance.tenant_id, user_id=instance.user_id):
        remove(hook)


def describe(hook):
    return {"url": hook.url, "events": hook.events, "format": hook.format,
            "scope": "tenant" if hook.user_id is None else "user"}


def _label(hook):
    return f"{hook.pk} {hook.url}"[:200]


def secret_of(hook):
    """The hook's secret in clear. One sealed under a key since rotated out (now a fallback) is sealed
    again under the current key, so it keeps working once the fallback is dropped."""
    from cryptography.fernet import InvalidToken
    current, any_key = _sealers()
    sealed = hook.sealed_secret.encode()
    try:
        return current.decrypt(sealed).decode()
    except InvalidToken:
        secret = any_key.decrypt(sealed)  # InvalidToken when no key opens it: the delivery fails, kept
        Webhook.objects.filter(pk=hook.pk, sealed_secret=hook.sealed_secret).update(
            sealed_secret=current.encrypt(secret).decode())
        return secret.decode()


def _sealers():
    """(the current key's cipher, one that opens with any key): a key of its own for this purpose
    derived from each of the platform's keys (jobs.transfers.sealing_keys), never the key itself."""
    from cryptography.fernet import Fernet, MultiFernet
    ciphers = [Fernet(base64.urlsafe_b64encode(hashlib.sha256(b"trainyard.notifications.secret\0" + key.encode())
                                               .digest())) for key in transfers.sealing_keys()]
    return ciphers[0], MultiFernet(ciphers)


# --- the rows a status change writes -------------------------------------------------------------
def event_of(job):
    if job.status == Status.HALTING and (job.status_reason or "").startswith("preempted"):
        return PREEMPTED
    return Status(job.status).value


def on_status_change(job, *, before, when):
    """jobs.states listener, inside the transaction of the change: one Delivery per hook that hears of it."""
    _write_deliveries(job, event_of(job), before=before, when=when)


def on_gpus_idle(job, *, since, policy, when):
    """jobs.idle listener, inside the transaction that flags the job: a GPUS_IDLE Delivery per hook."""
    idle = {"since": since.isoformat(), "below_percent": policy.below_percent, "minutes": policy.minutes,
            "action": policy.action}
    _write_deliveries(job, GPUS_IDLE, before=job.status, when=when, extra={"idle": idle})


def _write_deliveries(job, event, *, before, when, extra=None):
    """A row per hook that hears of it, in a fixed number of queries however many hooks the tenant has
    (this runs inside status changes, some of them under the scheduler's admission lock)."""
    # A disabled account's hooks hear nothing, as its sessions and tokens reach nothing.
    owned_by_active = Q(user=None) | Q(user__is_active=True)
    hooks = [hook for hook in Webhook.objects.filter(owned_by_active, tenant_id=job.tenant_id).order_by("pk")
             if not hook.events or event in hook.events]
    if not hooks:
        return
    seeing = tenancy.who_sees(job, {hook.user_id for hook in hooks if hook.user_id is not None})
    hooks = [hook for hook in hooks if (not job.private if hook.user_id is None else hook.user_id in seeing)]
    rows = Delivery.objects.bulk_create([Delivery(webhook=hook, job=job, event=event, payload={}) for hook in hooks])
    for hook, row in zip(hooks, rows):
        row.payload = payload(hook, job, event=event, before=before, when=when, extra=extra)
    Delivery.objects.bulk_update(rows, ["payload"])
    for row in rows:
        dispatch.send_on_commit(TASK, row.pk)
    _bound_open_rows([hook.pk for hook in hooks], when)


def _bound_open_rows(hook_ids, when):
    """Skip the oldest waiting deliveries of the hooks holding more than MAX_OPEN_PER_HOOK open ones.
    The first open one stays: it is being delivered or retried, and sends the next when done."""
    over = (Delivery.objects.filter(webhook_id__in=hook_ids, done_at=None).values("webhook_id")
            .annotate(open=Count("id")).filter(open__gt=MAX_OPEN_PER_HOOK))
    for hook in over:
        waiting = (Delivery.objects.filter(webhook_id=hook["webhook_id"], done_at=None).order_by("pk")
                   .values_list("pk", flat=True)[1:1 + hook["open"] - MAX_OPEN_PER_HOOK])
        Delivery.objects.filter(pk__in=list(waiting), done_at=None, claimed_at=None).update(
            done_at=when, gave_up=True,
            last_error=f"skipped: more than {MAX_OPEN_PER_HOOK} deliveries waited for this hook's receiver")


def payload(hook, job, *, event, before, when, extra=None):
    """The body of a delivery but its `sequence`, which its first try adds (_numbered)."""
    fields = {
        "event": event,
        "occurred_at": when.isoformat(),
        "tenant": job.tenant.slug,
        "job": {"id": job.id, "name": job.name, "status": job.status, "previous_status": before,
                "attempt": job.attempt, "reason": job.status_reason or "",
                "url": f"{settings.PUBLIC_URL.rstrip('/')}/jobs/{job.id}/"},
        **(extra or {}),
    }
    if hook.format == Webhook.Format.SLACK and event == GPUS_IDLE:
        idle = fields["idle"]
        text = (f"Trainyard job {slack_text(job.name)} ({job.id}) has kept its GPUs below {idle['below_percent']:g}% "
                f"for {idle['minutes']:g} min" + ("; halting it" if idle["action"] == "halt" else ""))
        return {"text": text, **fields}
    if hook.format == Webhook.Format.SLACK:
        verb = "was preempted" if event == PREEMPTED else f"is {job.status}"
        reason = f" ({slack_text(job.status_reason)})" if job.status_reason else ""
        return {"text": f"Trainyard job {slack_text(job.name)} ({job.id}) {verb}{reason}", **fields}
    return fields  # JSON: the structured fields are data, which the receiver escapes for where it shows them


_SLACK_CONTROL = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;"})
# Mentions Mattermost and Rocket.Chat (which take the Slack format) act on as plain words.
_MENTION = re.compile(r"@(?=(?:channel|here|all|everyone)\b)", re.IGNORECASE)


def slack_text(text):
    """`text` (a job's name, a reason quoting the learner's log) shown as itself in a Slack-format
    message: &, < and > escaped as Slack asks, so `<!channel>` and `<http://evil|click>` are not a
    mention and a link; and a word joiner after the @ of @channel/@here/@all/@everyone, which the
    chat servers that take this format would otherwise notify everyone for."""
    return _MENTION.sub("@\u2060", text.translate(_SLACK_CONTROL))


# --- doing one delivery --------------------------------------------------------------------------
def deliver(row_id):
    """The task's body: claim the row and POST it (jobs.outbox: failures kept, retried with backoff).

    A hook's deliveries go out one at a time, in order (a chat channel shows them as they arrive):
    a row with an earlier one of its hook still open waits for it, which sends this one when done.
    And a tenant delivers DELIVERING_PER_TENANT at once: a row finding its tenant's slot taken is
    sent again for WAIT_FOR_SLOT_S later."""
    row = Delivery.objects.filter(pk=row_id, done_at=None).values("webhook_id", "webhook__tenant_id").first()
    if row is None:
        return None  # done already, or its hook was removed
    if Delivery.objects.filter(webhook_id=row["webhook_id"], done_at=None, pk__lt=row_id).exists():
        # Sent when the earlier one is done (below). Until then the sweep leaves it be: a receiver that
        # is down collects rows by the thousand, and the sweep, resending the longest-due rows first,
        # sent those on every pass ahead of the other tenants' lost messages.
        Delivery.objects.filter(pk=row_id, done_at=None, claimed_at=None).update(
            due_at=timezone.now() + WAITING_SWEPT_AFTER)
        return None
    with throttling.slot(_delivering(), row["webhook__tenant_id"]) as free:
        if free:
            done = outbox.run_row(row_id, _post, model=Delivery, task=TASK)
    if not free:
        dispatch.send(TASK, row_id, countdown=WAIT_FOR_SLOT_S)
        return None
    if done is not None:
        following = (Delivery.objects.filter(webhook_id=row["webhook_id"], done_at=None, pk__gt=row_id)
                     .order_by("pk").values_list("pk", flat=True).first())
        if following is not None:
            # Due again, so that the sweep sends it should this message be lost.
            Delivery.objects.filter(pk=following, done_at=None).update(
                due_at=timezone.now() + timedelta(seconds=outbox.RESEND_MIN_S))
            dispatch.send(TASK, following)
    return done


def _numbered(row):
    """The delivery's `sequence`: 1, 2, 3 … over its hook's deliveries, given at its first try and kept
    for the next. A hook's deliveries go out one at a time, in the order of their changes, so the
    numbers grow with the changes; counted per hook, they tell a receiver nothing of how many events
    other hooks (other tenants') had, as the platform-wide row id did."""
    if row.sequence is not None:
        return row.sequence
    with transaction.atomic():
        Webhook.objects.filter(pk=row.webhook_id).update(numbered=F("numbered") + 1)
        number = Webhook.objects.filter(pk=row.webhook_id).values_list("numbered", flat=True).get()
        Delivery.objects.filter(pk=row.pk).update(sequence=number)
    return number


def delivery_id(row_id):
    """The X-Trainyard-Delivery header: the same on every try of a delivery, so a receiver can drop a
    repeat, and opaque (keyed with the platform's secret), unlike the platform-wide row id."""
    return salted_hmac("trainyard.webhook-delivery", str(row_id)).hexdigest()[:32]


def _delivering():
    # Held no longer than a delivery may take, so a worker that died frees its tenant's slot soon.
    return throttling.AtOnce("webhook-deliveries", limit=DELIVERING_PER_TENANT,
                             hold_s=math.ceil(settings.WEBHOOK_TIMEOUT_S) + 30)


def _post(row):
    hook = Webhook.objects.get(pk=row.webhook_id)
    if row.tries > MAX_TRIES:
        Delivery.objects.filter(pk=row.pk).update(gave_up=True)
        return
    body = json.dumps({**row.payload, "sequence": _numbered(row)}, separators=(",", ":"), sort_keys=True).encode()
    try:
        status = delivery.post(hook.url, body, {delivery.DELIVERY_HEADER: delivery_id(row.pk),
                                                delivery.EVENT_HEADER: row.event},
                               secret=secret_of(hook), policy=egress_policy(), timeout_s=settings.WEBHOOK_TIMEOUT_S)
    except delivery.DeliveryFailed as exc:
        Delivery.objects.filter(pk=row.pk).update(response_status=exc.status)
        raise
    Delivery.objects.filter(pk=row.pk).update(response_status=status)
