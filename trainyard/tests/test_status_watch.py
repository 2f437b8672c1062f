"""StatusWatch, the job socket Client.wait listens on, against a socket that replays messages."""
import contextlib
import json

import pytest

from trainyard.client import StatusWatch
from trainyard.errors import NotFound


class ReplayedSocket:
    def __init__(self, *messages):
        self.messages = [json.dumps(m) if not isinstance(m, str) else m for m in messages]

    def recv(self, timeout=None):
        if not self.messages:
            raise TimeoutError
        return self.messages.pop(0)


def watch(*messages):
    return StatusWatch(ReplayedSocket(*messages), contextlib.ExitStack())


def test_the_first_message_gives_the_job_without_a_read():
    job = {"id": "training-a", "status": "QUEUED"}
    assert watch({"type": "job", "job": job}).first_job(1) == job


def test_a_change_that_came_first_is_not_lost():
    done = {"id": "training-a", "status": "COMPLETED"}
    stream = watch({"type": "status", "job": "training-a", "status": "COMPLETED", "detail": done})
    assert stream.first_job(1) is None  # the caller reads the job, then listens
    assert stream.until(("COMPLETED",), 1) == done


def test_silence_or_something_unexpected_gives_no_job():
    assert watch().first_job(0.1) is None
    assert watch([1, 2]).first_job(1) is None
    assert watch("not json").first_job(1) is None
    assert watch({"type": "job", "job": "training-a"}).first_job(1) is None


def test_a_deletion_ends_the_wait_with_not_found():
    stream = watch({"type": "job", "job": {"id": "training-a", "status": "HALTED"}},
                   {"type": "deleted", "job": "training-a", "time": "2030-01-01T00:00:00+00:00"})
    assert stream.first_job(1)["status"] == "HALTED"
    with pytest.raises(NotFound, match="training-a was deleted") as gone:
        stream.until(("COMPLETED",), 1)
    assert gone.value.status == 404
