"""Comparing runs: several jobs' metrics side by side and what differs between their manifests.

One home for the comparison, so the REST endpoint (which the compare page's charts and `trainyard
compare` both read) and the page's server-rendered table say the same thing. Every job is looked up
through jobs.tenancy: an id the caller cannot see is "not found", exactly like an id that never existed.

Bounds: at most MAX_JOBS jobs, MAX_METRICS metric names, and MAX_ANSWER_POINTS points in all, shared
evenly by the lines, at most MAX_POINTS each (a longer line is thinned by the database to evenly spaced
points, its first and last kept, or for a very long one averaged over step buckets; it says so), so
the answer's size does not depend on what the runs logged, no line's points are read into Python
beyond its share, and the queries are a few per job, not a few per line.
"""
import math
import re
import shlex
from dataclasses import dataclass

from django.db import connection
from django.db.models import Avg, Count, F, FloatField, Max, Min
from django.db.models.functions import Cast, Floor
from django.http import Http404

from jobs import tenancy
from jobs.models import MetricPoint
from tenants import throttling
from trainyard.units import format_bytes

MIN_JOBS, MAX_JOBS = 2, 8
MAX_METRICS = 24
MAX_POINTS = 1000
MAX_ANSWER_POINTS = 24_000  # all lines of one answer together: each line gets an even share (point_share)
AVERAGE_ABOVE = 20_000  # points in one line beyond which the database averages them (see _job_lines)
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")

# Command-line flags that name the same hyperparameter, merged into one row so a sweep that spells it
# `--lr` in one job and `--learning-rate` in another still lines up.
LEARNING_RATE_FLAGS = ("lr", "learning-rate", "learning_rate", "base-lr", "base_lr", "lr0")
# When the command names no batch size, an elastic manifest's elastic.batch_size.global is the one.
BATCH_FLAGS = ("batch-size", "batch_size", "batch", "bs", "global-batch-size", "global_batch_size")
# (key, label, how to read it from a job): the manifest facts every comparison looks at, in table order.
FACTS = (
    ("framework", "framework", lambda job: f"{job.framework} {job.runtime.get('framework_version', '')}".strip()),
    ("learners", "learners", lambda job: str(job.learners)),
    ("gpus", "GPUs per learner", lambda job: str(job.gpus)),
    ("cpus", "CPUs per learner", lambda job: f"{job.cpus:g}"),
    ("memory", "memory per learner", lambda job: format_bytes(job.memory_bytes)),
    ("priority", "priority", lambda job: job.priority),
    ("elastic", "elastic", lambda job: _elastic_range(job)),
)


class CompareError(ValueError):
    """The ids parameter does not make sense; `field` is always "ids"."""

    field = "ids"


def parse_ids(values):
    """The job ids of `?ids=a,b,c` (the parameter may also repeat, as a plain HTML form sends it)."""
    ids = [part.strip() for value in values for part in str(value).split(",") if part.strip()]
    if len(ids) > MAX_JOBS:  # said before looking at each of a thousand ids
        raise CompareError(f"ids: give {MIN_JOBS} to {MAX_JOBS} job ids, comma-separated (got {len(ids)})")
    for job_id in ids:
        if not JOB_ID.fullmatch(job_id):
            raise CompareError(f"ids: {job_id[:60]!r} is not a job id (they look like training-ab12cd34)")
    if len(set(ids)) != len(ids):
        twice = next(job_id for job_id in ids if ids.count(job_id) > 1)
        raise CompareError(f"ids: {twice} is given twice")
    if len(ids) < MIN_JOBS:
        raise CompareError(f"ids: give {MIN_JOBS} to {MAX_JOBS} job ids, comma-separated (got {len(ids)})")
    return ids


@dataclass
class Comparison:
    jobs: list        # Job rows, in the order asked for
    rows: list        # [{key, label, values}] of the facts that differ, one value per job ("" = not set)
    same: list        # [{key, label, value}] of the facts every job shares
    metrics: list     # [{name, final, series}]: see metric_series()
    omitted_metrics: list  # names beyond MAX_METRICS, not charted

    def as_json(self):
        return {"jobs": [job_json(job) for job in self.jobs], "rows": self.rows, "same": self.same,
                "metrics": self.metrics, "omitted_metrics": self.omitted_metrics,
                "limits": {"max_jobs": MAX_JOBS, "max_metrics": MAX_METRICS, "max_points": self.points_per_line}}

    @property
    def points_per_line(self):
        """The most points a line of this answer may carry (its lines' share of MAX_ANSWER_POINTS): the
        page says long runs are cut to it."""
        return point_share(sum(len(metric["series"]) for metric in self.metrics))


def compare(membership, ids, *, charted=True):
    """The Comparison of these jobs as `membership` sees them; Http404 for the first id it cannot see,
    throttling.Busy while the tenant's other comparisons take every slot. `charted=False` leaves the
    lines' points out (see metric_series)."""
    found = {job.id: job for job in tenancy.jobs_of(membership).filter(pk__in=ids).select_related("owner")}
    for job_id in ids:
        if job_id not in found:
            raise Http404(f"No job {job_id!r} in tenant {membership.tenant.slug!r}.")
    jobs = [found[job_id] for job_id in ids]
    rows, same = differences(jobs)
    with throttling.held(throttling.COMPARISONS, membership.tenant_id):  # the lines' points are the heavy part
        metrics, omitted = metric_series(jobs, charted=charted)
    return Comparison(jobs=jobs, rows=rows, same=same, metrics=metrics, omitted_metrics=omitted)


def job_json(job):
    return {"id": job.id, "name": job.name, "status": job.status, "owner": job.owner.username,
            "attempt": job.attempt, "page_url": f"/jobs/{job.id}/"}


# --- what differs -----------------------------------------------------------------------------------
def facts_of(job):
    """{key: (label, value)} of one job: the manifest facts, then its hyperparameters from the command."""
    facts = {key: (label, read(job)) for key, label, read in FACTS}
    command = job.runtime.get("command") or (job.manifest.get("framework") or {}).get("command", "")
    env, flags = command_parameters(command)
    batch = _manifest_batch(job.manifest)
    for key, label, names, fallback in (("learning_rate", "learning rate", LEARNING_RATE_FLAGS, ""),
                                        ("batch_size", "batch size", BATCH_FLAGS, batch)):
        value = next((flags.pop(name) for name in names if name in flags), fallback)
        facts[key] = (label, value)
    for name in sorted(flags):
        facts[f"flag:{name}"] = (f"--{name}", flags[name])
    for name in sorted(env):
        facts[f"env:{name}"] = (f"{name}=", env[name])
    facts["command"] = ("command", command)
    facts["status"] = ("status", job.status)
    return facts


def differences(jobs):
    """([rows that differ], [facts every job shares]), in FACTS order then flags, env, command, status."""
    per_job = [facts_of(job) for job in jobs]
    keys = sorted({key for facts in per_job for key in facts}, key=_row_order)
    rows, same = [], []
    for key in keys:
        label = next(facts[key][0] for facts in per_job if key in facts)
        values = [facts.get(key, (label, ""))[1] for facts in per_job]
        if len(set(values)) > 1:
            rows.append({"key": key, "label": label, "values": values})
        elif values[0] != "":
            same.append({"key": key, "label": label, "value": values[0]})
    return rows, same


ROW_GROUPS = [key for key, _, _ in FACTS] + ["learning_rate", "batch_size", "flag:", "env:", "command", "status"]


def _row_order(key):
    """Manifest facts, learning rate, batch size, other flags A-Z, environment A-Z, command, status."""
    group = key.split(":", 1)[0] + ":" if ":" in key else key
    return ROW_GROUPS.index(group), key


def command_parameters(command):
    """({ENV: value} of leading VAR=value words, {flag: value} of --flag value / --flag=value / --flag)."""
    try:
        words = shlex.split(command or "")
    except ValueError:  # an unbalanced quote: the shell would refuse it too; compare the raw text only
        return {}, {}
    env, flags = {}, {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    for position, word in enumerate(words):
        if not word.startswith("--") or len(word) == 2:
            continue
        name, equals, value = word[2:].partition("=")
        if not equals:
            following = words[position + 1] if position + 1 < len(words) else None
            value = following if following is not None and not following.startswith("--") else "true"
        flags[name] = value
    return env, flags


def _elastic(manifest):
    """The manifest's `elastic` block, or {} (a job of a fixed size)."""
    block = (manifest or {}).get("elastic")
    return block if isinstance(block, dict) else {}


def _manifest_batch(manifest):
    """The global batch an elastic manifest declares (`elastic: {batch_size: {global: 256}}`), or ""."""
    batch = _elastic(manifest).get("batch_size")
    value = batch.get("global") if isinstance(batch, dict) else None
    return "" if value is None else str(value)


def _elastic_range(job):
    """`1–4 learners, lr linear` for an elastic job, "" for a job of a fixed size."""
    elastic = _elastic(job.manifest)
    if not elastic:
        return ""
    return (f"{elastic.get('min_learners', '?')}–{elastic.get('max_learners', '?')} learners, "
            f"lr {elastic.get('lr_scaling') or 'linear'}")


# --- metrics ----------------------------------------------------------------------------------------
def metric_series(jobs, *, charted=True):
    """([{name, final: [value|None per job], series: [{job, points: [[step, value]], count, thinned,
    averaged}]}], [metric names left out]).

    One line per job: the job's lowest-numbered learner that reported the metric (rank 0 in a
    distributed job, where every learner usually reports the same figure). All lines share
    MAX_ANSWER_POINTS, so the answer's size and the rows read stay bounded however many lines there are.
    `charted=False` (the page's table, whose charts come from the REST API) reads only each line's
    final value."""
    names = sorted(set(MetricPoint.objects.filter(job__in=jobs).values_list("name", flat=True).distinct()),
                   key=lambda name: (0 if "loss" in name.lower() else 1, name))
    shown, omitted = names[:MAX_METRICS], names[MAX_METRICS:]
    lines = _line_summaries(jobs, shown)
    share = point_share(len(lines)) if charted else 2
    read = {}
    for job in jobs:
        read.update(_job_lines(job, {key: line for key, line in lines.items() if key[0] == job.id}, share, charted))
    metrics = []
    for name in shown:
        series, final = [], []
        for job in jobs:
            line = read.get((job.id, name))
            final.append(line["final"] if line else None)
            if line and charted:
                series.append({"job": job.id, "points": line["points"], "count": line["count"],
                               "thinned": line["count"] > len(line["points"]), "averaged": line["averaged"]})
        metrics.append({"name": name, "final": final, "series": series})
    return metrics, omitted


def point_share(lines):
    """How many points each of this many lines may carry: an even share of MAX_ANSWER_POINTS, at most
    MAX_POINTS, and never fewer than a line's first and last."""
    return max(2, min(MAX_POINTS, MAX_ANSWER_POINTS // max(1, lines)))


def _line_summaries(jobs, names):
    """{(job id, name): {learner, count, low, high}} of every line, in one query: the lowest-numbered
    learner that reported the metric, its count of points and its step range."""
    lines = {}
    rows = (MetricPoint.objects.filter(job__in=jobs, name__in=names).values("job_id", "name", "learner")
            .annotate(count=Count("id"), low=Min("step"), high=Max("step")).order_by("job_id", "name", "-learner"))
    for row in rows:  # a lower learner comes later and takes the line
        lines[(row["job_id"], row["name"])] = row
    return lines


def _job_lines(job, lines, share, charted):
    """{(job id, name): {points, count, final, averaged}} of one job's lines.

    Up to AVERAGE_ABOVE points a line is exact: attempts joined on step, a later attempt's value winning
    where a resumed run repeats steps, a point without a step placed in the order it arrived, then
    thinned to `share` evenly spaced points by the database, in one query for all such lines of the job.
    Beyond that, the database averages the points into `share` equal step buckets (as the job page's
    chart does for long runs; a repeated step is then averaged with its repeat), and the final value is
    read on its own: the highest step's, of the latest attempt."""
    exact = [line for line in lines.values() if line["count"] <= AVERAGE_ABOVE]
    found = {}
    for name, points in _thinned(job, exact, share).items():
        line = lines[(job.id, name)]
        found[(job.id, name)] = {"points": points, "count": line["count"], "final": points[-1][1], "averaged": False}
    for line in lines.values():
        if line["count"] > AVERAGE_ABOVE:
            points = MetricPoint.objects.filter(job=job, name=line["name"], learner=line["learner"])
            last = (points.order_by(F("step").desc(nulls_last=True), "-attempt", "-id")
                    .values_list("value", flat=True).first())
            averages = _bucket_averages(points, line["low"], line["high"], share) if charted else []
            found[(job.id, line["name"])] = {"points": averages, "count": line["count"], "final": _finite(last),
                                            "averaged": True}
    return found


# Each line's points keyed by step (a point without one by its place among those, in arrival order), the
# latest arrival kept where keys repeat, then numbered: a line longer than the share keeps the positions
# ceil(i * last / (share - 1)), which include its first and last.
THINNED_SQL = """
WITH keyed AS (
    SELECT name, value, attempt, id, COALESCE(step, ROW_NUMBER() OVER (
        PARTITION BY name, step IS NULL ORDER BY attempt, id) - 1) AS x
    FROM {table} WHERE job_id = %s AND ({lines})
), latest AS (
    SELECT name, x, value, ROW_NUMBER() OVER (PARTITION BY name, x ORDER BY attempt DESC, id DESC) AS newest
    FROM keyed
), numbered AS (
    SELECT name, x, value, ROW_NUMBER() OVER (PARTITION BY name ORDER BY x) - 1 AS position,
        COUNT(*) OVER (PARTITION BY name) - 1 AS last
    FROM latest WHERE newest = 1
)
SELECT name, x, value FROM numbered
WHERE last < %s OR (position * %s) %% NULLIF(last, 0) < %s
ORDER BY name, x
"""


def _thinned(job, lines, share):
    """{name: [[step, value]]} of these lines of one job, each thinned to `share` points by the database."""
    if not lines:
        return {}
    sql = THINNED_SQL.format(table=MetricPoint._meta.db_table,
                             lines=" OR ".join(["(name = %s AND learner = %s)"] * len(lines)))
    params = [job.id, *(value for line in lines for value in (line["name"], line["learner"])),
              share, share - 1, share - 1]
    found = {}
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        for name, step, value in cursor.fetchall():
            found.setdefault(name, []).append([step, _finite(value)])
    return found


def _bucket_averages(points, low, high, buckets):
    """[[last step of the bucket, mean value]] over `buckets` equal buckets of steps low..high, in SQL
    (points without a step are left out of such a line)."""
    if low is None:
        return []
    width = max(1, math.ceil((high - low + 1) / buckets))
    # In floating point: a learner's steps may span the whole bigint range, where step - low overflows.
    bucket = Floor((Cast("step", FloatField()) - float(low)) / float(width))
    rows = (points.exclude(step=None).annotate(bucket=bucket).values("bucket").annotate(x=Max("step"), y=Avg("value"))
            .order_by("bucket").values_list("x", "y"))
    return [[x, _finite(y)] for x, y in rows]


def _finite(value):
    """NaN and infinity are not JSON: such a point is a gap in the line."""
    return value if value is not None and math.isfinite(value) else None

