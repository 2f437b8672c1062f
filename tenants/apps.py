from django.apps import AppConfig
from django.conf import settings


class TenantsConfig(AppConfig):
    name = "tenants"

    def ready(self):
        from django.db.models.signals import post_delete, pre_save

        from tenants import audit, people  # noqa: F401 - connect the audit log's signals
        from tenants.models import Membership
        # Leaving a tenant (however it happens) takes back its shared jobs and pending invitations.
        post_delete.connect(people.on_membership_deleted, sender=Membership, dispatch_uid="tenants.left")
        # An admin who loses the role, however it happens, takes back the invitations they sent.
        pre_save.connect(people.on_membership_saving, sender=Membership, dispatch_uid="tenants.admin-no-more")
        post_delete.connect(people.on_user_deleted, sender=settings.AUTH_USER_MODEL, dispatch_uid="tenants.user-gone")
