"""Celery tasks of the lifecycle manager. Thin and idempotent: a broker may deliver twice and a
worker may die mid-task, so each task takes ids, reloads, returns early if already done, and calls
into jobs.actions."""
import logging
import threading
from contextlib import contextmanager

import redis
from django.conf import settings
from redis.exceptions import LockError

from jobs import actions, admission
from jobs.backends.base import BackendError
from portal.celery import app

log = logging.getLogger(__name__)
SCHEDULE_LOCK = "trainyard:schedule-lock"
# A held lock expires this long after its holder stops renewing it. A worker killed mid-task runs no
# `finally`, so this bounds how long its lock blocks scheduling, reconcile or a job's finish.
LOCK_TTL_S = 6.0


def _redis():
    return redis.Redis.from_url(settings.REDIS_URL)


@contextmanager
def held(name, *, wait_s):
    """Hold a Redis lock while the body runs; yields False (body skipped by the caller) if it
    could not be taken within `wait_s`.

    The lock has a short TTL that a thread renews while the body runs: a long pass keeps it, and a
    worker that dies holding it frees it within LOCK_TTL_S instead of minutes.
    """
    lock = _redis().lock(name, timeout=LOCK_TTL_S, blocking_timeout=wait_s, thread_local=False)
    if not lock.acquire():
        yield False
        return
    done = threading.Event()

    def renew():
        while not done.wait(LOCK_TTL_S / 3):
            try:
                lock.reacquire()
            except (LockError, redis.RedisError):
                log.warning("could not renew %s; another pass may start", name, exc_info=True)

    renewer = threading.Thread(target=renew, name=f"renew {name}", daemon=True)
    renewer.start()
    try:
        yield True
    finally:
        done.set()
        renewer.join()
        try:
            lock.release()
        except LockError:  # expired meanwhile (Redis restarted, renewals failed): nothing to release
            pass


@app.task(ignore_result=True)
def schedule():
    # One pass at a time across all workers: two racing passes would count the same free GPUs.
    with held(SCHEDULE_LOCK, wait_s=30) as locked:
        if not locked:
            schedule.apply_async(countdown=1)
            return
        admission.run_cycle()


@app.task(ignore_result=True, autoretry_for=(BackendError,), retry_backoff=1, retry_backoff_max=30,
          max_retries=8)
def deploy_job(job_id, attempt):
    actions.deploy(job_id, attempt)


@app.task(ignore_result=True)
def finish_attempt(job_id, attempt):
    # Reconcile re-sends this for every job whose learners have ended, so it can arrive twice;
    # one storer at a time per job. If its worker dies, the lock expires and reconcile re-drives it.
    with held(f"trainyard:finish:{job_id}", wait_s=0) as locked:
        if not locked:
            return
        actions.finish_attempt(job_id, attempt)
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
    with held(SCHEDULE_LOCK, wait_s=1) as locked:
        if locked:  # else a scheduling pass is running; the next beat tick reconciles
            actions.reconcile()
