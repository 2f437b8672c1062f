from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"

    def ready(self):
        from tenants import audit, quotas  # noqa: F401 - connect the audit log and quota signals
