"""What the job detail computes for its answer costs the web process the same however much the job logged."""
import tracemalloc

import pytest
from django.utils import timezone

from jobs.models import MetricPoint
from jobs.serializers import latest_metrics
from tests.support.builders import job, member

pytestmark = pytest.mark.django_db


def test_the_latest_metrics_are_each_names_newest_point():
    target = job(member())
    now = timezone.now()
    MetricPoint.objects.bulk_create([MetricPoint(job=target, name=name, step=step, value=value, time=now)
                                     for name, step, value in [("loss", 1, 0.9), ("acc", 1, 0.1), ("loss", 2, 0.5),
                                                               ("acc", 2, 0.4), ("loss", None, 0.3)]])
    other = job(member(), name="other")
    MetricPoint.objects.create(job=other, name="loss", step=9, value=9.0, time=now)
    assert latest_metrics(target) == {"loss": {"value": 0.3, "step": None}, "acc": {"value": 0.4, "step": 2}}


def test_the_latest_metrics_do_not_read_every_point_into_the_web_process():
    # A learner may store a million points; every detail answer (REST, websocket, page) reads this.
    target = job(member())
    now = timezone.now()
    MetricPoint.objects.bulk_create([MetricPoint(job=target, name=f"m{i % 2}", step=i, value=float(i), time=now)
                                     for i in range(20_000)], batch_size=5000)
    tracemalloc.start()
    try:
        latest = latest_metrics(target)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert latest == {"m0": {"value": 19998.0, "step": 19998}, "m1": {"value": 19999.0, "step": 19999}}
    assert peak < 2 * 2**20, f"{peak / 2**20:.1f} MiB to find two points"
