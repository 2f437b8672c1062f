import pytest
from django.utils import timezone

from jobs import bulk
from jobs.models import LogLine
from tests.support.builders import job, member

pytestmark = pytest.mark.django_db

AWKWARD = ["tab\there", "back\\slash \\n not a newline", "crlf\r", "unicode ✓ — π", "", "x" * 10000]


def test_it_stores_every_line_exactly_as_given():
    target = job(member())
    now = timezone.now()
    bulk.insert_log_lines([(target.pk, i, 1, 0, "stdout", now, line) for i, line in enumerate(AWKWARD, start=1)])
    stored = list(LogLine.objects.filter(job=target).order_by("seq").values_list("line", "time"))
    assert [line for line, _ in stored] == AWKWARD
    assert all(abs((when - now).total_seconds()) < 0.001 for _, when in stored)
