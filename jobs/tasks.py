"""Celery tasks of the lifecycle manager. Thin and idempotent: a broker may deliver twice and a
worker may die mid-task, so each task takes ids, reloads, returns early if already done, and calls
into jobs.actions."""
import logging

import redis
from django.conf import settings

from jobs import actions
from jobs.backends.base import BackendError
from portal.celery import app

log = logging.getLogger(__name__)
SCHEDULE_LOCK = "trainyard:schedule-lock"


def _redis():
    return redis.Redis.from_url(settings.REDIS_URL)


@app.task(ignore_result=True)
def schedule():
    # One pass at a time across all workers: two racing passes would count the same free GPUs.
    lock = _redis().lock(SCHEDULE_LOCK, timeout=60, blocking_timeout=30)
    if not lock.acquire():
        schedule.apply_async(countdown=1)
        return
    try:
        actions.schedule_queued()
    finally:
        lock.release()


@app.task(ignore_result=True, autoretry_for=(BackendError,), retry_backoff=1, retry_backoff_max=30,
          max_retries=8)
def deploy_job(job_id, attempt):
    actions.deploy(job_id, attempt)


@app.task(ignore_result=True)
def finish_attempt(job_id, attempt):
    # Reconcile re-sends this for every job whose learners have ended, so it can arrive twice;
    # one storer at a time per job. If its worker dies, the lock expires and reconcile re-drives it.
    lock = _redis().lock(f"trainyard:finish:{job_id}", timeout=600, blocking_timeout=0)
    if not lock.acquire():
        return
    try:
        actions.finish_attempt(job_id, attempt)
    finally:
        lock.release()
    schedule.delay()  # resources were released


@app.task(ignore_result=True, autoretry_for=(BackendError,), retry_backoff=1, max_retries=5)
def teardown(job_id, attempt):
    actions.teardown(job_id, attempt)
    schedule.delay()


@app.task(ignore_result=True, autoretry_for=(BackendError,), retry_backoff=1, max_retries=5)
def halt_learners(job_id, attempt):
    actions.halt_learners(job_id, attempt)


@app.task(ignore_result=True)
def reconcile():
    lock = _redis().lock(SCHEDULE_LOCK, timeout=120, blocking_timeout=1)
    if not lock.acquire():
        return  # a scheduling pass is running; the next beat tick reconciles
    try:
        actions.reconcile()
    finally:
        lock.release()
