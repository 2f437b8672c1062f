"""Tenants (teams sharing the GPU pool), their members and API tokens."""
import hashlib
import secrets

from django.conf import settings
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

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "user"], name="one_membership_per_tenant")]

    @property
    def can_submit(self):
        return self.role in (self.Role.ADMIN, self.Role.RESEARCHER)


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

    @classmethod
    def issue(cls, user, name="default"):
        """Create a token for `user`; return (token, key). The key cannot be recovered later."""
        key = "ty_" + secrets.token_urlsafe(30)
        token = cls.objects.create(user=user, name=name, key_hash=hash_key(key), prefix=key[3:11])
        return token, key

    @classmethod
    def authenticate(cls, key):
        """The active token with this key, or None."""
        return (cls.objects.select_related("user")
                .filter(key_hash=hash_key(key), revoked_at__isnull=True, user__is_active=True).first())

    def __str__(self):
        return f"{self.user} / {self.name} ({self.prefix}…)"
