from django.apps import AppConfig


class NotificationsConfig(AppConfig):
    name = "notifications"

    def ready(self):
        from django.conf import settings
        from django.db.models.signals import post_delete

        from jobs import idle, outbox, states
        from notifications import services
        from notifications.models import Delivery
        from tenants.models import Membership

        # Inside the transaction of every status change: a committed transition has its delivery rows.
        states.listen(services.on_status_change)
        # Inside the transaction that flags a job's GPUs idle (jobs.idle): a GPUS_IDLE event.
        idle.listen(services.on_gpus_idle)
        # The reconcile pass sends again every delivery nobody works on, as it does follow-ups.
        outbox.register(Delivery, services.TASK, settings.WEBHOOK_QUEUE)
        # A member who leaves a tenant, however it happens, leaves no hook of theirs behind in it.
        post_delete.connect(services.on_membership_deleted, sender=Membership,
                            dispatch_uid="notifications.hooks-go-on-leave")
