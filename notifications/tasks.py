"""Thin task; named in jobs.tasks' namespace so jobs.dispatch sends it by name like the others."""
from celery import shared_task

from notifications import services


@shared_task(name="jobs.tasks." + services.TASK, ignore_result=True)
def deliver_webhook(row_id):
    services.deliver(row_id)
