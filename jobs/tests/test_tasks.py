"""The tasks' Redis locks: kept for as long as a task runs, freed soon after its worker dies."""
import os
import subprocess
import time

import pytest
import redis

from jobs import tasks
from portal.runner import embedded_redis_binary

LOCK = "trainyard:test-lock"


@pytest.fixture
def short_locks(settings, tmp_path, monkeypatch):
    socket = tmp_path / "redis.sock"
    server = subprocess.Popen([str(embedded_redis_binary()), "--port", "0", "--unixsocket", str(socket),
                               "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    settings.REDIS_URL = f"unix://{socket}"
    deadline = time.monotonic() + 10
    while not _answers(settings.REDIS_URL) and time.monotonic() < deadline:
        time.sleep(0.02)
    monkeypatch.setattr(tasks, "LOCK_TTL_S", 0.6)
    yield
    server.kill()
    server.wait()


def _answers(url):
    try:
        return redis.Redis.from_url(url).ping()
    except redis.RedisError:
        return False


def test_it_keeps_the_lock_while_a_long_task_runs(short_locks):
    with tasks.held(LOCK, wait_s=0) as locked:
        assert locked
        time.sleep(1.5)  # well past the TTL
        with tasks.held(LOCK, wait_s=0) as again:
            assert not again
    with tasks.held(LOCK, wait_s=0) as after:
        assert after


def test_a_worker_killed_while_holding_the_lock_frees_it_within_the_ttl(short_locks):
    child = os.fork()
    if child == 0:
        with tasks.held(LOCK, wait_s=5):
            os._exit(0)  # SIGKILLed mid-task: no `finally`, no release
    os.waitpid(child, 0)
    started = time.monotonic()
    with tasks.held(LOCK, wait_s=5) as locked:
        assert locked
    assert time.monotonic() - started < 1.0
