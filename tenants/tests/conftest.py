"""Fixtures for quota and admission tests: a cluster of a chosen size, and lifecycle tasks recorded
instead of sent (these tests exercise admission itself, not the Celery worker)."""
from types import SimpleNamespace

import pytest

from jobs import admission
from jobs.backends.base import Capacity, Node
from tests.support.builders import record_sends


@pytest.fixture
def cluster(monkeypatch):
    """cluster(gpus=4, nodes=1): the backend reports this capacity to the scheduler."""
    def make(gpus=4, nodes=1, cpus=64.0, memory_bytes=256 * 2**30):
        capacity = Capacity(nodes=tuple(Node(f"node-{i}", gpus, cpus, memory_bytes) for i in range(nodes)))
        monkeypatch.setattr(admission, "get_backend", lambda: SimpleNamespace(capacity=lambda: capacity))
        return capacity
    return make


@pytest.fixture
def sent(monkeypatch):
    """The lifecycle tasks sent (jobs.dispatch), as (name, args), instead of sending them to a broker."""
    return record_sends(monkeypatch)
