from django.apps import AppConfig


class NotificationsConfig(AppConfig):
    name = "notifications"

    def ready(self):
        from jobs import outbox, states
        from notifications import services
        from notifications.models import Delivery

        # Inside the transaction of every status change: a committed transition has its delivery rows.
        states.listen(services.on_status_change)
        # The reconcile pass sends again every delivery nobody works on, as it does follow-ups.
        outbox.register(Delivery, services.TASK)
