"""Fast inserts of log lines for the ingest path.

One learner can print tens of thousands of lines a second; the ORM's preparation of each row of a
bulk_create would cap ingestion well below that. These rows are simple and
trusted (built by jobs.ingest), so they go to the database as plain tuples: PostgreSQL's COPY
(several times faster than INSERT ... VALUES), SQLite's executemany.
"""
import io
from datetime import datetime

from django.db import connection

from jobs.models import LogLine

COLUMNS = ("job_id", "seq", "attempt", "learner", "stream", "time", "line")


def insert_log_lines(rows, *, along=()):
    """rows: tuples in COLUMNS order, `time` an aware datetime or its ISO 8601 text (the ingest path
    already formats it once for the websockets, and formatting is a good part of the cost per row).

    along: (sql, params) statements to run as well, before the lines, in the same round trip to
    PostgreSQL (a query string may hold statements before its COPY; otherwise each post's two updates
    of its progress cost two round trips of their own)."""
    table = connection.ops.quote_name(LogLine._meta.db_table)
    columns = ", ".join(connection.ops.quote_name(c) for c in COLUMNS)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            first = [cursor.cursor.mogrify(sql, params).decode() for sql, params in along]
            if rows:
                cursor.cursor.copy_expert("; ".join([*first, f"COPY {table} ({columns}) FROM STDIN"]), _copy_text(rows))
            elif first:
                cursor.execute("; ".join(first))
            return
        for sql, params in along:
            cursor.execute(sql, params)
        if rows:
            adapt = connection.ops.adapt_datetimefield_value
            placeholders = ", ".join(["%s"] * len(COLUMNS))
            cursor.executemany(f"INSERT INTO {table} ({columns}) VALUES ({placeholders})",
                               [(*row[:5], adapt(_datetime(row[5])), row[6]) for row in rows])


_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r", "\0": ""})  # PostgreSQL text cannot hold NUL


def _copy_text(rows):
    """Rows in COPY's text format: tab-separated, with backslash, tab and newlines escaped."""
    buffer = io.StringIO()
    write = buffer.write
    for job_id, seq, attempt, learner, stream, time, line in rows:
        # Rare, and five `in` checks cost less than always translating.
        if "\\" in line or "\t" in line or "\n" in line or "\r" in line or "\0" in line:
            line = line.translate(_COPY_ESCAPES)
        if not isinstance(time, str):
            time = time.isoformat()
        write(f"{job_id}\t{seq}\t{attempt}\t{learner}\t{stream}\t{time}\t{line}\n")
    buffer.seek(0)
    return buffer


def _datetime(value):
    return datetime.fromisoformat(value) if isinstance(value, str) else value
