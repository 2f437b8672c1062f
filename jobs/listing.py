"""Listing a tenant's jobs: filters, sort orders and keyset pages, shared by the REST list and the
jobs page so both read the same query parameters the same way.

Keyset ("older/newer than this row") rather than OFFSET pages: page 2,000 of 100,000 jobs costs what
page 1 costs, because every page is one index range scan (see the (tenant, status, created_at) and
(tenant, created_at) indexes on Job).
"""
import base64
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone

from django.db.models import Q

from jobs.models import Status

PAGE_SIZE = 50
MAX_PAGE_SIZE = 200
# sort parameter -> (model field, descending); the id breaks ties so every row has one place
SORTS = {
    "-created": ("created_at", True), "created": ("created_at", False),
    "name": ("name", False), "-name": ("name", True),
    "status": ("status", False), "-status": ("status", True),
}
DEFAULT_SORT = "-created"
# Only what a list row shows (the REST list serializes more and loads whole rows).
LIST_COLUMNS = ("id", "name", "description", "framework", "status", "status_reason", "wait_reason", "attempt",
                "learners", "gpus", "owner__username", "created_at", "started_at", "finished_at", "priority",
                "gpus_idle_since", "gpus_idle_attempt")


class ListingError(ValueError):
    """A query parameter that does not make sense; `field` names it."""

    def __init__(self, field_name, message):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


@dataclass(frozen=True)
class JobQuery:
    statuses: tuple = ()
    user: str = ""
    framework: str = ""
    text: str = ""
    sort: str = DEFAULT_SORT
    size: int = PAGE_SIZE
    after: tuple | None = field(default=None)  # keyset cursor: (sort value, id) of the last row shown
    before: tuple | None = field(default=None)  # ... or of the first row shown, to page back

    @classmethod
    def from_params(cls, params):
        statuses = tuple(s.strip().upper() for s in params.get("status", "").split(",") if s.strip())
        if unknown := [s for s in statuses if s not in Status.values]:
            raise ListingError("status", f"{unknown[0]!r} is not a job status; use one of {', '.join(Status.values)}")
        sort = params.get("sort") or DEFAULT_SORT
        if sort not in SORTS:
            raise ListingError("sort", f"{sort!r} is not a sort order; use one of {', '.join(SORTS)}")
        try:
            size = int(params.get("size") or PAGE_SIZE)
        except ValueError:
            raise ListingError("size", f"{params.get('size')!r} is not a whole number") from None
        if not 1 <= size <= MAX_PAGE_SIZE:
            raise ListingError("size", f"must be between 1 and {MAX_PAGE_SIZE}")
        return cls(statuses=statuses, user=params.get("user", "").strip(),
                   framework=params.get("framework", "").strip(), text=params.get("q", "").strip(), sort=sort,
                   size=size, after=_decode_cursor(params.get("after"), "after", sort),
                   before=_decode_cursor(params.get("before"), "before", sort))

    @property
    def is_filtered(self):
        return bool(self.statuses or self.user or self.framework or self.text)

    def filter(self, jobs):
        if self.statuses:
            jobs = jobs.filter(status__in=self.statuses)
        if self.user:
            jobs = jobs.filter(owner__username=self.user)
        if self.framework:
            jobs = jobs.filter(framework=self.framework)
        if self.text:
            jobs = jobs.filter(Q(name__icontains=self.text) | Q(id__icontains=self.text)
                               | Q(description__icontains=self.text))
        return jobs

    def ordered(self, jobs, *, reverse=False):
        column, descending = SORTS[self.sort]
        descending ^= reverse
        prefix = "-" if descending else ""
        return jobs.order_by(f"{prefix}{column}", f"{prefix}id")

    def page(self, jobs):
        """One page of the filtered, sorted jobs: a Page with rows and the cursors around them."""
        jobs = self.filter(jobs)
        column, descending = SORTS[self.sort]
        if self.before is not None:  # walk backwards from the first row shown, then flip
            rows = list(self.ordered(jobs.filter(_beyond(column, not descending, self.before)),
                                     reverse=True)[:self.size + 1])
            more_before = len(rows) > self.size
            rows = rows[:self.size][::-1]
            return Page(rows, self, has_before=more_before, has_after=True)
        if self.after is not None:
            jobs = jobs.filter(_beyond(column, descending, self.after))
        rows = list(self.ordered(jobs)[:self.size + 1])
        return Page(rows[:self.size], self, has_before=self.after is not None, has_after=len(rows) > self.size)


@dataclass
class Page:
    rows: list
    query: JobQuery
    has_before: bool
    has_after: bool

    def cursor(self, row):
        column, _ = SORTS[self.query.sort]
        value = getattr(row, column)
        value = value.isoformat() if hasattr(value, "isoformat") else value
        return base64.urlsafe_b64encode(json.dumps([value, row.id]).encode()).decode().rstrip("=")

    @property
    def after_cursor(self):
        return self.cursor(self.rows[-1]) if self.has_after and self.rows else None

    @property
    def before_cursor(self):
        return self.cursor(self.rows[0]) if self.has_before and self.rows else None


def _beyond(column, descending, cursor):
    """Rows after (value, id) in the sort order: the keyset condition."""
    value, job_id = cursor
    op = "lt" if descending else "gt"
    return Q(**{f"{column}__{op}": value}) | Q(**{column: value, f"id__{op}": job_id})


MAX_CURSOR_CHARS = 400  # a cursor holds one sort value (a name is at most 200 characters) and a job id


def _decode_cursor(text, name, sort):
    """(sort value, job id) from a cursor made by Page.cursor for the same sort, or ListingError. Anything
    else (not base64, not JSON, another shape, a value of the wrong type) would reach the database as a
    comparison it cannot make, so each part is checked here."""
    if not text:
        return None
    refused = ListingError(name, "is not a cursor from a previous page; start again from the first page")
    if len(text) > MAX_CURSOR_CHARS:  # also keeps json.loads far from its recursion limit
        raise refused
    try:
        decoded = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    except (ValueError, TypeError):
        raise refused from None
    if not (isinstance(decoded, list) and len(decoded) == 2
            and all(isinstance(part, str) and "\x00" not in part for part in decoded)):
        raise refused
    value, job_id = decoded
    if SORTS[sort][0] == "created_at":
        try:  # in UTC, as stored: 0001-01-01T00:00+14:00 has no UTC time and must fail here, not in SQL
            value = datetime.fromisoformat(value)
            value = value.astimezone(timezone.utc) if value.tzinfo else None
        except (ValueError, OverflowError):
            raise refused from None
        if value is None:
            raise refused
    return value, job_id
