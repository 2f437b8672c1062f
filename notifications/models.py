"""Webhooks (a user's or a tenant's) and their deliveries, which are outbox rows (jobs.outbox)."""
from django.conf import settings
from django.db import models
from django.utils import timezone

from jobs.models import Job
from tenants.models import Tenant


class Webhook(models.Model):
    class Format(models.TextChoices):
        SLACK = "slack"  # {"text": ...} plus the structured fields: Slack, Mattermost, Rocket.Chat take it
        JSON = "json"  # the structured fields only

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="webhooks")
    # A user's own hook; null for a tenant's hook (managed by the tenant's admins).
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE,
                             related_name="webhooks")
    url = models.URLField(max_length=2000)
    events = models.JSONField(default=list)  # event names (notifications.services.EVENTS); empty = all
    format = models.CharField(max_length=10, choices=Format.choices, default=Format.SLACK)
    # The signing secret, encrypted with a key derived from SECRET_KEY; shown in clear once, at creation.
    sealed_secret = models.TextField()
    created = models.DateTimeField(default=timezone.now)
    created_by = models.CharField(max_length=150)
    # How many of its deliveries have been numbered (Delivery.sequence): the hook's own count, so the
    # numbers a receiver sees say nothing of other hooks' or tenants' events.
    numbered = models.PositiveBigIntegerField(default=0)

    def __str__(self):
        return f"webhook {self.pk} -> {self.url}"


class Delivery(models.Model):
    """One event for one hook. The row is written in the transaction of the status change, so it
    exists exactly when the change does; jobs.outbox claims, retries and sweeps it."""

    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="+")
    event = models.CharField(max_length=20)
    payload = models.JSONField()  # the event as it was at the change (its time included)
    # Its place among its hook's deliveries, given at its first try (they go out one at a time, in order).
    sequence = models.PositiveBigIntegerField(null=True, blank=True)
    created = models.DateTimeField(default=timezone.now)
    due_at = models.DateTimeField(default=timezone.now)
    claimed_at = models.DateTimeField(null=True, blank=True)
    claimed_by = models.CharField(max_length=100, blank=True)
    done_at = models.DateTimeField(null=True, blank=True)
    tries = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)
    response_status = models.PositiveIntegerField(null=True, blank=True)
    gave_up = models.BooleanField(default=False)

    class Meta:
        indexes = [models.Index(fields=["done_at", "due_at"], name="delivery_open"),
                   # A hook's open rows: counted at every status change, and the one before a row found.
                   models.Index(fields=["webhook", "id"], condition=models.Q(done_at=None), name="delivery_open_per_hook")]

    def __str__(self):
        return f"delivery {self.pk} ({self.event} of {self.job_id})"
