# The Celery app is made current whenever Django loads the project, so @shared_task and
# jobs.dispatch (which sends tasks by name) use it in every process: web, worker, beat, manage.py.
from portal.celery import app as celery_app

__all__ = ("celery_app",)
