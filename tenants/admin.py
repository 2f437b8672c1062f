"""The admin console for platform admins: tenants with their usage against quota, members, quotas,
usage records and the audit log. Quota changes made here reach queued jobs at once (the quota's
save re-runs the scheduler)."""
from django.contrib import admin
from django.db.models import Count
from django.template.defaultfilters import pluralize
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from tenants import quotas
from tenants.models import (ApiToken, AuditEntry, GroupMapping, Invitation, Membership, Quota, SsoIdentity, Tenant,
                            UsageRecord)


def usage_bar(used, limit, unit=""):
    """A small bar for list pages: used against limit, or the bare figure when there is no limit."""
    shown = f"{used:g}{unit}"
    if limit is None:
        return format_html('<span class="ty-usage">{} <small>(no limit)</small></span>', shown)
    share = 100.0 if limit == 0 else min(100.0, 100.0 * used / limit)
    level = "full" if share >= 100 else "high" if share >= 80 else "ok"
    return format_html(
        '<span class="ty-usage"><span class="ty-bar ty-bar-{}" role="meter" aria-valuenow="{}" aria-valuemin="0" '
        'aria-valuemax="{}" title="{} of {}"><span style="width:{}%"></span></span> {} / {}</span>',
        level, f"{used:g}", f"{limit:g}", shown, f"{limit:g}{unit}", f"{share:.0f}", shown, f"{limit:g}{unit}")


admin.site.site_header = "Trainyard admin console"
admin.site.site_title = "Trainyard admin"
admin.site.index_title = "Tenants, quotas, usage and jobs"


class QuotaInline(admin.StackedInline):
    model = Quota
    can_delete = False
    extra = 1
    max_num = 1
    fieldsets = [
        ("In use at once", {"fields": [("gpus", "cpus", "memory_bytes"), ("jobs", "gpus_per_user"), "can_borrow"]}),
        ("Budget per period", {"fields": [("gpu_hours", "cpu_hours"), ("period", "budget_mode")]}),
        ("Scheduling", {"fields": ["high_priority"]}),
        ("Submissions (empty: the platform's default)", {"fields": [("queued_jobs", "submissions_per_minute")]}),
        ("Disk", {"fields": [("storage_bytes", "disk_per_job_bytes")]}),
    ]


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "member_count", "gpus_now", "gpu_hours_this_period", "jobs_now", "budget_mode"]
    list_filter = ["quota__budget_mode", "quota__can_borrow", "quota__period", ("quota", admin.EmptyFieldListFilter)]
    search_fields = ["slug", "name", "memberships__user__username"]
    readonly_fields = ["member_pages", "usage_summary"]
    fields = ["slug", "name", "member_pages", "usage_summary"]
    # Members are listed and changed on their own pages (MembershipAdmin), a page at a time: as rows of
    # this form, a large tenant's page grew with every member and its quota could no longer be saved
    # (a form holds at most DATA_UPLOAD_MAX_NUMBER_FIELDS fields).
    inlines = [QuotaInline]
    actions = None

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("quota").annotate(members=Count("memberships"))

    @staticmethod
    def _summary(tenant):
        """What the list's columns show: the quota (read with the row) and usage now and this period.
        Computed once per row, and only that: the full summary also sums every file the tenant keeps
        and six periods of history, which made each tenant's size every list page's cost."""
        if not hasattr(tenant, "_usage_summary"):
            quota = getattr(tenant, "quota", None) or Quota(tenant=tenant)
            usage = quotas.usage_of(tenant, quota=quota)
            tenant._usage_summary = {"quota": quota.as_dict(), "usage": {
                "gpus": usage.gpus, "jobs": usage.jobs, "gpu_hours": usage.gpu_hours}}
        return tenant._usage_summary

    @admin.display(description="members", ordering="members")
    def member_count(self, tenant):
        return tenant.members

    @admin.display(description="GPUs in use")
    def gpus_now(self, tenant):
        s = self._summary(tenant)
        return usage_bar(s["usage"]["gpus"], s["quota"]["gpus"])

    @admin.display(description="GPU-hours this period")
    def gpu_hours_this_period(self, tenant):
        s = self._summary(tenant)
        return usage_bar(round(s["usage"]["gpu_hours"], 2), s["quota"]["gpu_hours"], " h")

    @admin.display(description="jobs running")
    def jobs_now(self, tenant):
        s = self._summary(tenant)
        return usage_bar(s["usage"]["jobs"], s["quota"]["jobs"])

    @admin.display(description="budget")
    def budget_mode(self, tenant):
        return self._summary(tenant)["quota"]["budget_mode"] if hasattr(tenant, "quota") else "-"

    @admin.display(description="members")
    def member_pages(self, tenant):
        if tenant.pk is None:
            return "-"
        listed = reverse("admin:tenants_membership_changelist") + "?" + urlencode({"tenant__id__exact": tenant.pk})
        add = reverse("admin:tenants_membership_add") + "?" + urlencode({"tenant": tenant.pk})
        return format_html('<a href="{}">{} member{}</a> · <a href="{}">add one</a>',
                           listed, tenant.members, pluralize(tenant.members), add)

    @admin.display(description="usage")
    def usage_summary(self, tenant):
        if tenant.pk is None:
            return "-"
        s = quotas.summary(tenant)
        usage, quota = s["usage"], s["quota"]
        rows = [("GPUs in use", usage_bar(usage["gpus"], quota["gpus"])),
                ("CPUs in use", usage_bar(usage["cpus"], quota["cpus"])),
                ("jobs running", usage_bar(usage["jobs"], quota["jobs"])),
                ("GPU-hours this period", usage_bar(usage["gpu_hours"], quota["gpu_hours"], " h")),
                ("CPU-hours this period", usage_bar(usage["cpu_hours"], quota["cpu_hours"], " h")),
                ("queued", f'{s["queued"]["jobs"]} jobs, {s["queued"]["gpus"]} GPUs')]
        if s["budget"]["reason"]:
            rows.append(("budget", s["budget"]["reason"]))
        table = format_html_join("", "<tr><th>{}</th><td>{}</td></tr>", rows)
        history = format_html_join("", "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
                                   ((h["period_start"][:10], f'{h["gpu_hours"]:.2f}', f'{h["cpu_hours"]:.2f}')
                                    for h in s["history"]))
        return format_html('<table class="ty-usage-table">{}</table><h4>History</h4><table class="ty-usage-table">'
                           '<tr><th>period from</th><th>GPU-hours</th><th>CPU-hours</th></tr>{}</table>',
                           table, history)

    class Media:
        css = {"all": ["css/admin-usage.css"]}


class ReadOnlyAdmin(admin.ModelAdmin):
    """Records the platform writes itself (usage by the job state machine, the audit log by model
    signals): shown with filters, never added, edited or deleted by hand."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    """Who belongs to which tenant with which role, a page at a time (a tenant's page links its own).
    Platform admins add people here directly; tenant admins invite them (tenants.people)."""
    list_display = ["user", "tenant", "role"]
    list_filter = ["role", "tenant"]
    search_fields = ["user__username", "tenant__slug"]
    list_select_related = ["user", "tenant"]
    autocomplete_fields = ["user"]
    fields = ["tenant", "user", "role"]
    ordering = ["tenant__slug", "user__username"]

    def get_readonly_fields(self, request, obj=None):
        # A membership is one person's in one tenant: moved to another, it would keep what was shared
        # with the first (taken back only when it is deleted). Delete it and add the other instead.
        return ["tenant", "user"] if obj is not None else []


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyAdmin):
    list_display = ["job", "tenant", "user", "attempt", "gpus", "cpus", "started_at", "ended_at"]
    list_filter = ["tenant", ("ended_at", admin.EmptyFieldListFilter), "started_at"]
    search_fields = ["job__id", "job__name", "user__username", "tenant__slug"]
    date_hierarchy = "started_at"
    list_select_related = ["job", "tenant", "user"]


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = ["time", "actor", "action", "target_type", "target", "tenant"]
    list_filter = ["target_type", "action", "tenant"]
    search_fields = ["actor", "target"]
    date_hierarchy = "time"
    list_select_related = ["tenant"]  # an entry's tenant may be empty, which select_related() leaves out


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ["user", "name", "prefix", "created_at", "last_used_at", "revoked_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["user__username", "name", "prefix"]
    # The key itself is never stored; its hash is not worth showing either.
    exclude = ["key_hash"]
    # A key acts as its user until it expires or is revoked: the console may revoke one (or rename it),
    # never hand it to someone else, lengthen it, or bring a revoked one back.
    readonly_fields = ["user", "prefix", "created_at", "last_used_at", "expires_at"]

    def get_readonly_fields(self, request, obj=None):
        if obj is not None and obj.revoked_at is not None:
            return [*self.readonly_fields, "revoked_at"]
        return self.readonly_fields

    def has_add_permission(self, request):
        # A key is shown once, to the person it is made for (their Account page, the API); one made
        # here would have no key anyone saw, and no hash to match.
        return False


@admin.register(Invitation)
class InvitationAdmin(admin.ModelAdmin):
    """Invitations waiting for an answer; an operator may withdraw one (delete). Nobody joins through
    here: platform admins add members directly (MembershipAdmin, linked from the tenant's page)."""
    list_display = ["username", "tenant", "role", "invited_by", "created_at"]
    list_filter = ["tenant", "role"]
    search_fields = ["username", "tenant__slug", "invited_by"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(GroupMapping)
class GroupMappingAdmin(admin.ModelAdmin):
    """Which of the identity provider's groups make someone a member of which tenant, with which role
    (tenants.sso; read at every sign-in and session re-check, beside TRAINYARD_OIDC_GROUP_MAP)."""

    list_display = ["group", "tenant", "role"]
    list_filter = ["role", "tenant"]
    search_fields = ["group", "tenant__slug"]


@admin.register(SsoIdentity)
class SsoIdentityAdmin(admin.ModelAdmin):
    list_display = ["user", "issuer", "subject", "created_at", "checked_at"]
    search_fields = ["user__username", "subject"]
    readonly_fields = ["user", "issuer", "subject", "created_at", "checked_at"]
    exclude = ["refresh_token"]  # a credential for the person's account at the provider: never shown
