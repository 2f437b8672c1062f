from django.contrib import admin

from jobs.models import Artifact, IdleGpuPolicy, Job, JobEvent


class JobEventInline(admin.TabularInline):
    model = JobEvent
    extra = 0
    can_delete = False
    readonly_fields = ["time", "from_status", "to_status", "attempt", "actor", "reason"]


class ArtifactInline(admin.TabularInline):
    model = Artifact
    extra = 0
    can_delete = False
    readonly_fields = ["name", "kind", "attempt", "size", "sha256", "complete"]


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    """Read-only: status changes only go through the state machine (jobs.states)."""

    list_display = ["id", "name", "tenant", "owner", "status", "attempt", "framework", "learners", "gpus",
                    "created_at", "deleted_at"]
    list_filter = ["status", "framework", "tenant", ("deleted_at", admin.EmptyFieldListFilter)]
    search_fields = ["id", "name", "owner__username"]
    inlines = [JobEventInline, ArtifactInline]

    def has_change_permission(self, request, obj=None):
        return False

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        # Deleting a job keeps its row for its usage records and history (jobs.deletion, DELETE on the API).
        return False


@admin.register(IdleGpuPolicy)
class IdleGpuPolicyAdmin(admin.ModelAdmin):
    """A tenant's idle-GPU policy (jobs.idle); its admins also set it with PUT /api/v1/tenants/current/idle-gpus/."""
    list_display = ["tenant", "below_percent", "minutes", "action", "updated_at", "updated_by"]
    readonly_fields = ["updated_at"]
