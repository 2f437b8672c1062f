"""A page of a job's metric points is one range of an index, however many points other jobs hold."""
import json

import pytest
from django.db import connection

from jobs.models import MetricPoint
from tests.support.builders import job, member

pytestmark = pytest.mark.django_db
OTHERS = 200_000  # points of another tenant's job, stored after this job's


def _points(target, count):
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {MetricPoint._meta.db_table} (job_id, attempt, learner, name, value, time) "
                       "SELECT %s, 1, 0, 'loss', n, now() FROM generate_series(1, %s) AS n", [target.id, count])


def test_a_page_after_a_jobs_last_points_reads_none_of_the_points_stored_after_them():
    if connection.vendor != "postgresql":
        pytest.skip("the plan asked about is PostgreSQL's")
    early = job(member())
    _points(early, 1000)
    _points(job(member("team-b", "bob")), OTHERS)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {MetricPoint._meta.db_table}")
    last = early.metric_points.order_by("-id").values_list("id", flat=True).first()
    page = early.metric_points.filter(id__gt=last - 3).order_by("id")[:10_001]  # as JobMetrics asks, near the end
    sql, params = page.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        plan = cursor.fetchone()[0]
    plan = plan if isinstance(plan, list) else json.loads(plan)

    def scanned(node):
        here = node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
        return here + sum(scanned(child) for child in node.get("Plans", []))
    assert len(list(page)) == 3
    # Without the (job, id) index: every point of the job, or every later point of every job, is read.
    assert scanned(plan[0]["Plan"]) < 100, plan
