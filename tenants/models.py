"""Tenants (teams sharing the GPU pool), their members and API tokens."""
import hashlib
import secrets

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone


class Tenant(models.Model):
    slug = models.SlugField(unique=True)
    name = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self):
        return self.slug


class Membership(models.Model):
    class Role(models.TextChoices):
        ADMIN = "admin"
        RESEARCHER = "researcher"
        VIEWER = "viewer"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=20, choices=Role.choices, default=Role.RESEARCHER)
    # The tenant a request without X-Trainyard-Tenant acts in: only the user sets it (tenants.people.
    # set_default_tenant); without one it is the tenant they joined first (the lowest id).
    is_default = models.BooleanField(default=False)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "user"], name="one_membership_per_tenant"),
                       models.UniqueConstraint(fields=["user"], condition=models.Q(is_default=True),
                                               name="one_default_tenant_per_user")]

    @property
    def can_submit(self):
        return self.role in (self.Role.ADMIN, self.Role.RESEARCHER)

    @property
    def is_admin(self):
        return self.role == self.Role.ADMIN


class Invitation(models.Model):
    """A tenant admin's offer of membership, addressed to a username; it becomes a Membership only
    when that user accepts it (tenants.people). It is kept whether or not such a user exists, so
    inviting tells the admin nothing about which accounts exist."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invitations")
    username = models.CharField(max_length=150)
    role = models.CharField(max_length=20, choices=Membership.Role.choices, default=Membership.Role.RESEARCHER)
    invited_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "username"], name="one_invitation_per_tenant")]

    def __str__(self):
        return f"{self.username} to {self.tenant} as {self.role}"


def hash_key(key):
    return hashlib.sha256(key.encode()).hexdigest()


class ApiToken(models.Model):
    """A named API key. Only its hash is stored; the key itself is shown once, at creation."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, default="default")
    key_hash = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(max_length=8)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Personal tokens from `trainyard login --sso` (tenants.sso) expire; service accounts' do not.
    expires_at = models.DateTimeField(null=True, blank=True)

    @classmethod
    def issue(cls, user, name="default", *, expires_at=None):
        """Create a token for `user`; return (token, key). The key cannot be recovered later."""
        key = "ty_" + secrets.token_urlsafe(30)
        token = cls.objects.create(user=user, name=name, key_hash=hash_key(key), prefix=key[3:11],
                                   expires_at=expires_at)
        return token, key

    @classmethod
    def authenticate(cls, key):
        """The active token with this key, or None."""
        return (cls.objects.select_related("user")
                .filter(key_hash=hash_key(key), revoked_at__isnull=True, user__is_active=True)
                .filter(models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=timezone.now())).first())

    def __str__(self):
        return f"{self.user} / {self.name} ({self.prefix}…)"


class GroupMapping(models.Model):
    """Members of the identity provider's `group` belong to `tenant` with `role` (tenants.sso).

    Kept beside the TRAINYARD_OIDC_GROUP_MAP environment variable: both are read at every sign-in."""

    group = models.CharField(max_length=200, help_text="a value of the provider's groups claim")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="group_mappings")
    role = models.CharField(max_length=20, choices=Membership.Role.choices, default=Membership.Role.RESEARCHER)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["group", "tenant"], name="one_mapping_per_group_and_tenant")]

    def __str__(self):
        return f"{self.group} → {self.tenant} as {self.role}"


class SsoIdentity(models.Model):
    """The account an identity provider's subject signs in as: (issuer, sub) is the identity, never
    the e-mail address or the username, which a provider may let people change."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="sso_identities")
    issuer = models.CharField(max_length=300)
    subject = models.CharField(max_length=255)
    created_at = models.DateTimeField(default=timezone.now)
    checked_at = models.DateTimeField(null=True, blank=True)  # the provider last confirmed the groups
    # The device flow's refresh token: how the API tokens of someone who signs in through the provider
    # ask it again about their owner (tenants.sso.token_refusal). A browser session keeps its own.
    refresh_token = models.TextField(blank=True, default="")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["issuer", "subject"], name="one_user_per_sso_subject")]
        verbose_name_plural = "SSO identities"

    def __str__(self):
        return f"{self.user} ({self.subject} at {self.issuer})"


# A limit below zero means nothing a limit could; the scheduler refuses one (gpu_scheduler.model).
NOT_NEGATIVE = [MinValueValidator(0)]


class Quota(models.Model):
    """What a tenant may hold at once and consume per period. An empty field means no limit.

    `gpus`/`cpus`/`memory_bytes` are the tenant's guaranteed share of the pool; with `can_borrow`
    its jobs may also run on capacity nobody else is using, and give it back (halted through their
    checkpoint) when its owner needs it. GPU-/CPU-hour budgets count per `period`; over a `hard`
    budget nothing new starts, over a `soft` one new jobs run only on idle capacity, at the lowest
    priority, and yield to anyone.
    """

    class Period(models.TextChoices):
        DAY = "day"
        WEEK = "week"
        MONTH = "month"

    class BudgetMode(models.TextChoices):
        HARD = "hard"
        SOFT = "soft"

    class HighPriority(models.TextChoices):
        """Who may submit jobs with `priority: high` (tenants.priority)."""
        PLATFORM = "", "the platform's default (TRAINYARD_HIGH_PRIORITY)"
        ADMINS = "admins", "tenant admins only"
        EVERYONE = "everyone", "every member who may submit"
        NOBODY = "nobody", "nobody"

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="quota")
    gpus = models.PositiveIntegerField(null=True, blank=True, help_text="GPUs in use at once")
    cpus = models.FloatField(null=True, blank=True, validators=NOT_NEGATIVE, help_text="CPUs in use at once")
    memory_bytes = models.BigIntegerField(null=True, blank=True, validators=NOT_NEGATIVE, help_text="memory in use at once (bytes)")
    jobs = models.PositiveIntegerField(null=True, blank=True, help_text="jobs running at once")
    gpus_per_user = models.PositiveIntegerField(null=True, blank=True, help_text="GPUs one member may hold at once")
    gpu_hours = models.FloatField(null=True, blank=True, validators=NOT_NEGATIVE, help_text="GPU-hours per period")
    cpu_hours = models.FloatField(null=True, blank=True, validators=NOT_NEGATIVE, help_text="CPU-hours per period")
    # Disk (jobs.disk): what the tenant's jobs keep stored (results, checkpoints, logs, code archives)
    # and the largest cap one job may have on any of its folders or its log.
    storage_bytes = models.BigIntegerField(
        null=True, blank=True, validators=NOT_NEGATIVE,
        help_text="stored results, checkpoints, logs and code archives of all its jobs (bytes)")
    disk_per_job_bytes = models.BigIntegerField(null=True, blank=True, validators=NOT_NEGATIVE,
                                                help_text="largest disk cap a job may have per folder or log (bytes)")
    period = models.CharField(max_length=10, choices=Period.choices, default=Period.MONTH)
    budget_mode = models.CharField(max_length=10, choices=BudgetMode.choices, default=BudgetMode.HARD)
    can_borrow = models.BooleanField(default=False, help_text="may use idle capacity beyond its GPU/CPU/memory quota")
    high_priority = models.CharField(max_length=10, choices=HighPriority.choices, default="", blank=True,
                                     help_text="who may submit jobs with priority high")
    # Intake (jobs.submission): what the tenant may have queued at once and submit per minute; empty
    # means the platform's default (TRAINYARD_MAX_QUEUED_JOBS, TRAINYARD_SUBMITS_PER_MINUTE), not no limit.
    queued_jobs = models.PositiveIntegerField(
        null=True, blank=True, help_text="jobs queued at once (empty: the platform's TRAINYARD_MAX_QUEUED_JOBS)")
    submissions_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="job submissions per minute (empty: the platform's TRAINYARD_SUBMITS_PER_MINUTE)")
    updated_at = models.DateTimeField(auto_now=True)

    LIMITS = ("gpus", "cpus", "memory_bytes", "jobs", "gpus_per_user", "gpu_hours", "cpu_hours", "storage_bytes",
              "disk_per_job_bytes")
    INTAKE = ("queued_jobs", "submissions_per_minute")  # empty: the platform's default (tenants.quotas.intake_of)
    # What may be set (tenants.quotas.set_quota) and is shown (as_dict, the API's QuotaSerializer).
    SETTINGS = (*LIMITS, "period", "budget_mode", "can_borrow", "high_priority", *INTAKE)

    def __str__(self):
        return f"quota of {self.tenant}"

    def as_dict(self):
        return {name: getattr(self, name) for name in self.SETTINGS}


class UsageRecord(models.Model):
    """Resources one job attempt held, from admission to release (one row per attempt).

    Written by jobs.states.transition() in the same transaction as the status change, so usage and
    job history never disagree; `ended_at` is empty while the attempt still holds its resources.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage_records")
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="usage_records")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="usage_records")
    attempt = models.PositiveIntegerField()
    gpus = models.PositiveIntegerField()  # all learners together
    cpus = models.FloatField()
    memory_bytes = models.BigIntegerField()
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "attempt"], name="one_usage_record_per_attempt")]
        indexes = [models.Index(fields=["tenant", "ended_at"], name="usage_tenant_open"),
                   models.Index(fields=["tenant", "started_at"], name="usage_tenant_started")]

    def seconds_within(self, start, end, now):
        """Seconds this record held its resources inside [start, end)."""
        begin = max(self.started_at, start)
        finish = min(self.ended_at or now, end)
        return max(0.0, (finish - begin).total_seconds())


class AuditEntry(models.Model):
    """Who changed a quota, a membership or a token, when, and what it was before and after."""

    time = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.CharField(max_length=200)  # username, or "command:<name>" for manage.py commands
    action = models.CharField(max_length=20)  # created | changed | deleted
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit")
    target_type = models.CharField(max_length=40)  # quota, membership, invitation, token, webhook, job, ...
    target = models.CharField(max_length=200)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-time", "-id"]
        verbose_name_plural = "audit entries"

    def __str__(self):
        return f"{self.time:%Y-%m-%d %H:%M} {self.actor} {self.action} {self.target_type} {self.target}"
