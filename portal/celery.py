"""The Celery application: the lifecycle manager's worker and beat run this (`celery -A portal.celery`).

portal/__init__.py imports it, so it is the current app in every process that loads Django; tasks
are @shared_task and are sent by name (jobs.dispatch), so nothing imports this module to enqueue.
Scheduling cycles are not among them: the scheduling loop runs them in a process of its own
(`manage.py run_scheduler`, jobs.scheduler_loop); beat's schedule (settings.CELERY_BEAT_SCHEDULE)
is the reconcile pass, the autoscaler's periodic pass and the idle-GPU pass (jobs.idle).
"""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

app = Celery("trainyard")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["jobs", "notifications"])
