"""Websockets: `/ws/jobs/<id>/` streams one job, `/ws/jobs/` the status changes of a tenant's jobs.

A connection is authenticated (browser session; for scripts an API token, as `?token=` or the REST
API's `Authorization: Token` header) and scoped to a tenant
exactly like the REST API; another tenant's job id is refused without a word about it.

Access is checked again whenever something that grants it changes (jobs.live sends the user's
group an `access.recheck`), and every ACCESS_RECHECK_S besides: a socket whose credential, membership
or job access has gone closes with the code an outsider gets at connect (4401 or 4404), and the list
socket stops forwarding private jobs its user may no longer see. A deleted job is gone for everyone: its
sockets are told (`{"type": "deleted"}`) and closed with 4404, and a socket opened for it later is refused.
"""
import asyncio
import collections
import contextlib
import logging
import weakref
from importlib import import_module
from types import SimpleNamespace
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from channels.consumer import get_handler_name
from channels.exceptions import StopConsumer
from django.conf import settings
from django.contrib import auth
from django.contrib.auth.models import AnonymousUser
from django.http import Http404

from jobs import listhub, live, prometheus_series, tenancy
from tenants import access, sso, throttling
from tenants.models import Membership
from tenants.auth import user_for_key

log = logging.getLogger(__name__)
BACKLOG_LINES = 5000
BACKLOG_LOG_BYTES = 4 * 2**20  # of the newest BACKLOG_LINES, as many as fit
BACKLOG_POINTS_PER_LINE = 2000  # of each line of a chart (metric, learner, attempt): spread over all of it
# In all, over every line: a job with many lines gets fewer points of each (at least two: its ends),
# and its lines past BACKLOG_CHART_LINES (in name order) none, so one socket's backlog stays one
# message a browser can take.
BACKLOG_POINTS = 200_000
BACKLOG_CHART_LINES = 1000
# The longest a send waits for the client to take it. One that reads nothing fills its connection's
# buffer; a send to it would then wait for ever, and with it whatever sends to the next socket (a
# tenant's list hub) while its messages queue without bound.
SEND_TIMEOUT_S = 5.0
# Nothing announces a token's or a session's expiry, and an announced change may be lost on its way
# (the channel layer delivers at most once): each socket checks its access this often as well.
ACCESS_RECHECK_S = 60.0
CLOSE_NOT_FOUND = 4404
CLOSE_UNAUTHORIZED = 4401
# Past settings.WEBSOCKETS_PER_USER of a user's sockets open in this process (both streams together):
# each holds memory, a subscription and a recheck a minute, so one member opening thousands would take
# the web process from everyone else.
CLOSE_TOO_MANY = 4429
_open_sockets = weakref.WeakKeyDictionary()  # event loop -> Counter(user id -> its sockets open there)
# Backlogs one tenant's sockets read at once in a web process: a job's backlog reads its log and spreads
# its metric points in the database, on the loop's thread pool that every socket's checks share, so a
# tenant opening many sockets on a large job waits for its own backlogs, never for the other tenants'.
BACKLOGS_PER_TENANT = 2
_backlog_turns = weakref.WeakKeyDictionary()  # event loop -> {tenant id: asyncio.Semaphore}


def _db(function):
    """database_sync_to_async on any of the loop's pool threads, not channels' one thread for synchronous
    code: sockets opening at once queued their credential checks there past the handshake's time limit.
    Calls share nothing, and each closes the connection it opened, as database_sync_to_async does."""
    return database_sync_to_async(function, thread_sensitive=False)


class Stalled(Exception):
    """A socket's client took nothing for SEND_TIMEOUT_S."""


class _ScopedConsumer(AsyncJsonWebsocketConsumer):
    groups_joined = ()
    tenant_slug = None  # the tenant the socket was opened in: every later check is about that one
    stream = ""  # its name on /metrics (trainyard_websocket_connections)
    counted = False
    rechecks = None  # the task that asks this socket to check its access now and then
    holder = None  # the user whose sockets this one counts among (None until it has a place)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            # A handler that raised (a statement cancelled, the database gone) ends the socket without
            # its disconnect: its place, its rechecks and its subscriptions would stay for good.
            with contextlib.suppress(Exception):
                await self.disconnect(1011)

    async def accept(self, subprotocol=None, headers=None):
        await super().accept(subprotocol, headers)
        if not self.counted:
            self.counted = True
            prometheus_series.SOCKETS.opened(self.stream)
        if self.rechecks is None:
            self.rechecks = asyncio.create_task(self._recheck_now_and_then())

    async def _recheck_now_and_then(self):
        # Through the socket's own channel, so the check runs between its other messages, never beside one.
        while True:
            await asyncio.sleep(ACCESS_RECHECK_S)
            try:
                await self.channel_layer.send(self.channel_name, {"type": "access.recheck"})
            except Exception:  # the layer is down: the socket hears nothing else either; try again later
                log.warning("a %s socket's access recheck could not be sent", self.stream, exc_info=True)

    async def send(self, text_data=None, bytes_data=None, close=False):
        """Channels' send, within SEND_TIMEOUT_S: a socket that takes nothing that long is let go. The
        sender gets Stalled (a tenant's list hub then drops the socket), and the socket's own task
        stops it, at once when it was the sender (dispatch), else at its `socket.stalled` message."""
        try:
            await asyncio.wait_for(super().send(text_data=text_data, bytes_data=bytes_data, close=close),
                                   SEND_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.info("a %s socket took nothing for %.0fs; it is let go", self.stream, SEND_TIMEOUT_S)
            await self.channel_layer.send(self.channel_name, {"type": "socket.stalled"})
            raise Stalled() from None

    async def socket_stalled(self, event):
        await self._let_go()

    async def _let_go(self):
        await self.disconnect(1011)  # leaves every group and hub: nothing more is queued for it
        raise StopConsumer()

    async def receive(self, text_data=None, bytes_data=None):
        """Clients send nothing: a message is not read (decoding a large one held the event loop), and
        the socket that sent it is closed."""
        await self.close(code=1003)

    def take_place(self, user_id):
        """Count this socket among its user's open ones; False when they hold WEBSOCKETS_PER_USER already."""
        counts = _open_sockets.setdefault(asyncio.get_running_loop(), collections.Counter())
        if counts[user_id] >= settings.WEBSOCKETS_PER_USER:
            return False
        counts[user_id] += 1
        self.holder = user_id
        return True

    def _give_place_back(self):
        user_id, self.holder = self.holder, None
        counts = _open_sockets.get(asyncio.get_running_loop())
        if user_id is not None and counts is not None:
            counts[user_id] -= 1
            if counts[user_id] <= 0:
                del counts[user_id]

    async def admitted(self, membership):
        """The membership, refusing the socket (and answering None) when there is none or its user has
        no place left."""
        if membership is None:
            await self.refuse(CLOSE_UNAUTHORIZED)
            return None
        if not self.take_place(membership.user_id):
            await self.refuse(CLOSE_TOO_MANY)
            return None
        return membership

    async def refuse(self, code):
        # Accept-then-close, so the browser sees why (4401/4404) instead of an anonymous 1006;
        # nothing is sent in between.
        await self.accept()
        await self.close(code=code)

    async def dispatch(self, message):
        # Channels (4.2 on) hops into the process's one synchronous thread for every message to close
        # stale database connections, which queued a fan-out behind that thread's requests. Here every
        # database access goes through _db, which closes them itself, so a message that reads nothing does not hop.
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        try:
            await handler(message)
        except Stalled:
            await self._let_go()

    def query(self, name):
        values = parse_qs(self.scope.get("query_string", b"").decode()).get(name)
        return values[0] if values else None

    async def join(self, *groups):
        self.groups_joined = groups
        for group in groups:
            await self.channel_layer.group_add(group, self.channel_name)

    async def disconnect(self, code):
        self._give_place_back()
        if self.rechecks is not None:
            self.rechecks.cancel()
        if self.counted:
            self.counted = False
            prometheus_series.SOCKETS.closed(self.stream)
        await self.leave()

    async def leave(self):
        """Stop everything sent to this socket (a subclass with other sources leaves them too)."""
        groups, self.groups_joined = self.groups_joined, ()
        for group in groups:
            await self.channel_layer.group_discard(group, self.channel_name)

    async def end(self, code):
        """Access ended while open: stop forwarding at once, then close as an outsider is refused."""
        await self.leave()
        await self.close(code=code)

    @_db
    def _membership(self):
        """The membership this socket acts through now, or None. Authenticates afresh on every call, so a
        revoked token, a logout, a password change or a deactivation is seen at the next check."""
        user = self._session_user()
        if not user.is_authenticated:
            user = self._token_user()
        headers = dict(self.scope.get("headers", []))
        requested = self.tenant_slug or headers.get(b"x-trainyard-tenant", b"").decode() or self.query("tenant")
        try:
            membership = access.membership_for(user, requested)
        except access.NoTenant:
            return None
        self.tenant_slug = membership.tenant.slug
        return membership

    def _token_user(self):
        # Guessing keys here is throttled per address like on the REST API (tenants.throttling).
        key, address = self.query("token") or self._header_token(), (self.scope.get("client") or ("",))[0]
        if not key or throttling.retry_after(throttling.TOKEN_FAILURES, address):
            return None
        user = user_for_key(key)
        if user is None:
            throttling.record(throttling.TOKEN_FAILURES, address)
        return user

    def _header_token(self):
        """The key of an `Authorization: Token <key>` header, as the REST API reads it ("" when none)."""
        header = dict(self.scope.get("headers", [])).get(b"authorization", b"").decode("latin-1")
        scheme, _, key = header.partition(" ")
        return key.strip() if scheme.lower() == "token" else ""

    def _session_user(self):
        # A fresh read of the session row: the scope's session object caches what it loaded at connect.
        session = self.scope.get("session")
        key = getattr(session, "session_key", None)
        if not key:
            return AnonymousUser()
        store = import_module(settings.SESSION_ENGINE).SessionStore(session_key=key)
        user = auth.get_user(SimpleNamespace(session=store))
        if not sso.session_vouched_for(store, user):  # single sign-on's recheck, as the pages have it
            store.delete()  # the session ends for the pages too
            return AnonymousUser()
        if store.modified:  # what the recheck wrote (its time, the provider's fresh tokens)
            store.save()
        return user


class JobConsumer(_ScopedConsumer):
    stream = "job"
    status_only = False

    async def connect(self):
        membership = await self.admitted(await self._membership())
        if membership is None:
            return
        self.job_id = self.scope["url_route"]["kwargs"]["job_id"]
        job = await self._job(membership, self.job_id)
        if job is None:
            await self.refuse(CLOSE_NOT_FOUND)
            return
        # Join before reading the backlog, so nothing published in between is missed; the
        # client drops the duplicates by seq.
        await self.join(live.job_group(self.job_id), live.user_group(membership.user_id))
        await self.accept()
        # `?only=status`: a script waiting for the job's end (trainyard.Client.wait) gets the job
        # and its status changes, not its logs and metrics.
        self.status_only = self.query("only") == "status"
        # `&until=COMPLETED,FAILED`: the statuses the script waits for; only a change to one of them
        # carries the job's detail (reading it takes a query, and a change it is read for holds up the
        # next one: STORING's, just before COMPLETED's). Without it, every change carries it.
        until = self.query("until")
        self.detail_for = frozenset(until.split(",")) if until else None
        since = _int(self.query("since"), 0)
        async with _backlog_turn(membership.tenant_id):
            backlog = await self._backlog(job, since, with_output=not self.status_only)
        if backlog is None:  # deleted since it was found: its deletion's message may have gone before the join
            await self.end(CLOSE_NOT_FOUND)
            return
        for message in backlog:
            await self.send_json(message)

    async def access_recheck(self, event):
        membership = await self._membership()
        if membership is None:
            await self.end(CLOSE_UNAUTHORIZED)
        elif await self._job(membership, self.job_id) is None:
            await self.end(CLOSE_NOT_FOUND)

    @_db
    def _job(self, membership, job_id):
        try:
            return tenancy.job_or_404(membership, job_id)
        except Http404:
            return None

    @_db
    def _backlog(self, job, since, *, with_output=True):
        from jobs.serializers import JobDetailSerializer, log_line_json, metric_json
        job.refresh_from_db()
        if job.deleted_at is not None:
            return None
        messages = [{"type": "job", "job": JobDetailSerializer(job).data}]
        if not with_output:
            return messages
        lines, size = [], 0
        for line in job.log_lines.filter(seq__gt=since).order_by("-seq")[:BACKLOG_LINES]:
            size += len(line.line)
            if size > BACKLOG_LOG_BYTES:
                break
            lines.append(log_line_json(line))
        lines.reverse()
        for start in range(0, len(lines), live.CHUNK):
            messages.append({"type": "logs", "lines": lines[start:start + live.CHUNK]})
        points = [metric_json(p) for p in _spread_points(job)]
        if points:
            messages.append({"type": "metrics", "points": points})
        return messages

    async def job_status(self, event):
        message = {"type": "status", **event["status"], "job_detail": event["job"]}
        if self.status_only and (self.detail_for is None or event["status"]["status"] in self.detail_for):
            # The job as the REST API shows it, read after the change committed: a waiting script
            # returns it instead of reading it again (an HTTP request at the end of every job's wait).
            # The change to a status scripts wait for brings it along (jobs.models.AT_REST; jobs.live).
            message["detail"] = event.get("detail") or await self._detail()
        await self.send_json(message)

    async def job_deleted(self, event):
        """The job was deleted (jobs.deletion): the client hears it, then the socket closes as a socket
        opened for the job from now on is refused."""
        await self.send_json({"type": "deleted", "job": self.job_id, "time": event.get("time")})
        await self.end(CLOSE_NOT_FOUND)

    @_db
    def _detail(self):
        # This socket may see this job: checked at connect, and again whenever access may have ended.
        return live.detail_of(self.job_id)

    async def job_logs(self, event):
        if not self.status_only:
            await self.send_json({"type": "logs", "lines": event["lines"]})

    async def job_metrics(self, event):
        if not self.status_only:
            await self.send_json({"type": "metrics", "points": event["points"]})


class JobListConsumer(_ScopedConsumer):
    """Status changes of the tenant's jobs, from the web process's one subscription for the tenant
    (jobs.listhub: it sends each burst of changes as one message, and a private job's only to the
    sockets that may see it)."""
    stream = "list"
    tenant_id = None

    async def connect(self):
        membership = await self.admitted(await self._membership())
        if membership is None:
            return
        self.membership = membership
        await self.join(live.user_group(membership.user_id))
        await self.accept()
        self.tenant_id = membership.tenant_id
        await listhub.join(self.tenant_id, self)

    async def leave(self):
        await super().leave()
        if self.tenant_id is not None:
            tenant_id, self.tenant_id = self.tenant_id, None
            await listhub.leave(tenant_id, self)

    async def access_recheck(self, event):
        # A changed role is picked up here, so private jobs are forwarded by the role held now.
        membership = await self._membership()
        if membership is None:
            await self.end(CLOSE_UNAUTHORIZED)
        else:
            self.membership = membership

    @property
    def sight(self):
        """What may_see's answer rests on (the membership it reads again): sockets with the same see alike."""
        return self.membership.pk

    @_db
    def may_see(self, job_ids):
        """Of these private jobs, those this socket's user may see (asked by the tenant's hub for the private
        jobs' changes of a burst, one query for the batch)."""
        membership = self._membership_now()
        if membership is None:
            return set()
        return set(tenancy.jobs_of(membership).filter(pk__in=list(job_ids)).values_list("pk", flat=True))

    @_db
    def may_have_seen(self, job_ids):
        """Of these deleted private jobs, those this socket's user could see before they went (asked by the
        tenant's hub for a burst's deletions, one query for the batch)."""
        membership = self._membership_now()
        if membership is None:
            return set()
        return set(tenancy.deleted_jobs_of(membership).filter(pk__in=list(job_ids)).values_list("pk", flat=True))

    def _membership_now(self):
        # Read again: the hub's changes and this socket's access.recheck arrive on different channels, so
        # a change may be checked before the socket has heard of a demotion.
        return Membership.objects.select_related("tenant", "user").filter(pk=self.membership.pk).first()


def _int(value, default):
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return default


# Each chart line's points numbered in arrival order; a line longer than the share keeps the
# positions where position * (share - 1) wraps past its last, which include its first and last. Lines
# are numbered in name order, and those past the first few are left out.
SPREAD_SQL = """
SELECT * FROM {table} WHERE id IN (
    SELECT id FROM (
        SELECT id, ROW_NUMBER() OVER (PARTITION BY name, learner, attempt ORDER BY id) - 1 AS position,
               COUNT(*) OVER (PARTITION BY name, learner, attempt) - 1 AS last,
               DENSE_RANK() OVER (ORDER BY name, learner, attempt) AS line
        FROM {table} WHERE job_id = %s
    ) numbered
    WHERE line <= %s AND (last < %s OR (position * %s) %% NULLIF(last, 0) < %s)
)
ORDER BY id
"""


def _backlog_turn(tenant_id):
    """The tenant's turns at reading a backlog in this event loop (BACKLOGS_PER_TENANT at once)."""
    turns = _backlog_turns.setdefault(asyncio.get_running_loop(), {})
    return turns.setdefault(tenant_id, asyncio.Semaphore(BACKLOGS_PER_TENANT))


def _spread_points(job):
    """The job's metric points for a socket's backlog: each line's whole length, at most
    BACKLOG_POINTS_PER_LINE of its points and BACKLOG_POINTS in all (a job may hold millions, which a
    page draws no better), of its first BACKLOG_CHART_LINES lines."""
    from jobs.models import MetricPoint
    lines = min(_chart_lines(job), BACKLOG_CHART_LINES)
    share = max(2, min(BACKLOG_POINTS_PER_LINE, BACKLOG_POINTS // max(lines, 1)))
    return MetricPoint.objects.raw(SPREAD_SQL.format(table=MetricPoint._meta.db_table),
                                   [job.id, BACKLOG_CHART_LINES, share, share - 1, share - 1])


def _chart_lines(job):
    """How many lines (metric, learner, attempt) the job's charts have."""
    from jobs.models import MetricPoint
    return MetricPoint.objects.filter(job=job).values("name", "learner", "attempt").distinct().count()
