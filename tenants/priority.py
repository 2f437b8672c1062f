"""Who may ask for `priority: high`.

A high-priority job goes before every normal one of its tenant and may halt the tenant's lower-
priority work (and, in the shared pool, another tenant's while its own tenant is under its fair
share: gpu_scheduler), so asking for it is a right, not a manifest field anyone may set. The rule is
the tenant's `Quota.high_priority` when set, else the platform's `TRAINYARD_HIGH_PRIORITY`
(default: tenant admins only). `low` and `normal` are always allowed.
"""
from django.conf import settings

from tenants.models import Quota

RULES = ("admins", "everyone", "nobody")  # Quota.HighPriority without its "use the platform's" choice
HIGH = "high"


class PriorityRefused(Exception):
    """The member may not submit a job with this priority; the message names the rule and where it is set."""


def rule_of(tenant):
    """(rule, where it comes from) for the tenant: its own setting, else the platform's default."""
    own = Quota.objects.filter(tenant=tenant).values_list("high_priority", flat=True).first()
    if own:
        return own, f"tenant {tenant.slug}'s quota setting high_priority={own}"
    return settings.HIGH_PRIORITY, f"the platform's default TRAINYARD_HIGH_PRIORITY={settings.HIGH_PRIORITY}"


def may_ask(membership, priority):
    """Raise PriorityRefused unless the member may submit a job of this priority in their tenant."""
    if priority != HIGH:
        return
    rule, source = rule_of(membership.tenant)
    if rule == "everyone" or (rule == "admins" and membership.is_admin):
        return
    who = "tenant admins only" if rule == "admins" else "nobody"
    raise PriorityRefused(f"priority high is refused: in tenant {membership.tenant.slug!r} it is for {who} "
                          f"({source}) and your role is {membership.role}; submit with priority normal or low")
