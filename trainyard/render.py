"""How the CLI shows things: tables, times, a job's summary, the final message, and the progress line
drawn while uploading or downloading. Pure formatting over the API's JSON; no network."""
import io
import json
import re
import sys
import time
from datetime import datetime
from urllib.parse import urljoin

from trainyard.client import RESTING_STATUSES
from trainyard.units import format_bytes

human_bytes = format_bytes

QUOTA_ROWS = (("GPUs in use", "gpus"), ("CPUs in use", "cpus"), ("memory in use", "memory_bytes"),
              ("jobs running", "jobs"), ("GPU-hours this period", "gpu_hours"),
              ("CPU-hours this period", "cpu_hours"), ("stored results/checkpoints/logs", "storage_bytes"))


def note(message):
    """A message for the person at the terminal (stderr), never mixed into what scripts read."""
    print(f"trainyard: {message}", file=sys.stderr, flush=True)


def isatty(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# C0 and C1 control characters but newline and tab, unless they start a colour (SGR: ESC [ digits m).
_CONTROL = re.compile(r"(?!\x1b\[[0-9;]{0,32}m)[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text):
    """`text` with its control characters written out (\\x1b), colours kept: what the server sends (a
    job's name, a learner's log line, an error) cannot move the cursor, clear or retitle the
    terminal, or set its clipboard (OSC 52)."""
    return _CONTROL.sub(lambda match: repr(match.group())[1:-1], text)


class TerminalText(io.TextIOBase):
    """A terminal stream that shows every control character it is given as `visible` writes it.
    `raw`: the terminal itself, for the CLI's own drawing (Progress)."""

    def __init__(self, raw):
        self.raw = raw

    def write(self, text):
        self.raw.write(visible(text))
        return len(text)

    def flush(self):
        self.raw.flush()

    def isatty(self):
        return True

    def fileno(self):
        return self.raw.fileno()


def for_terminal(stream):
    """`stream` as the CLI writes to it: through TerminalText when it is a terminal, as it is when it
    is a file or a pipe (a script's, or `trainyard logs ID > out.log`: the bytes as stored)."""
    return TerminalText(stream) if isatty(stream) and not isinstance(stream, TerminalText) else stream


class Progress:
    """One self-overwriting status line on stderr, drawn only when stderr is a terminal."""

    def __init__(self, label, *, stream=None, enabled=None):
        stream = stream or sys.stderr
        self.stream = getattr(stream, "raw", stream)  # its own \r and erase pass; the label is made visible
        self.enabled = isatty(self.stream) if enabled is None else enabled
        self.label, self.drawn_at = visible(label), 0.0

    def update(self, done, total):
        now = time.monotonic()
        if not self.enabled or (now - self.drawn_at < 0.1 and done < total):
            return
        self.drawn_at = now
        percent = f"{100 * done // total:3d}%" if total else ""
        self.stream.write(f"\r\x1b[K{self.label} {percent} {human_bytes(done)} / {human_bytes(total)}")
        self.stream.flush()

    def clear(self):
        if self.enabled:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def local_time(stamp):
    if not stamp:
        return "-"
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return str(stamp)


def table_lines(headers, rows):
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    return ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [headers, *rows]]


def print_table(headers, rows):
    for line in table_lines(headers, rows):
        print(line)


def print_json(data):
    print(json.dumps(data, indent=2, sort_keys=False))


def number(value):
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def quota_value(name, value, missing):
    if value is None:
        return missing
    if "memory" in name or name.endswith("bytes"):
        return human_bytes(value)
    return number(value)


def render_job(job, base_url):
    """The readable summary `trainyard show` prints."""
    manifest = job.get("manifest") or {}
    framework = manifest.get("framework") if isinstance(manifest.get("framework"), dict) else {}
    status = job.get("status", "?")
    rows = [("status", status + (f" — {job['status_reason']}" if job.get("status_reason") else ""))]
    if job.get("wait_reason") and status == "QUEUED":
        rows.append(("waiting", job["wait_reason"]))
    if job.get("queue_position") is not None:
        rows.append(("queue", f"position {job['queue_position']}"))
    attempt = str(job.get("attempt", "-"))
    if job.get("exit_code") is not None:
        attempt += f", exit code {job['exit_code']}"
    rows += [("attempt", attempt),
             ("framework", " ".join(filter(None, [job.get("framework"), str(framework.get("version") or "")])))]
    if framework.get("command"):
        rows.append(("command", " ".join(str(framework["command"]).split())))
    learners = job.get("learners", 1)
    rows += [("resources", f"{learners} learner{'s' if learners != 1 else ''} × "
                           f"{job.get('gpus', 0)} GPU, {number(job.get('cpus', 0))} CPU, "
                           f"{human_bytes(job.get('memory_bytes'))}"),
             ("priority", job.get("priority", "-")),
             ("owner", f"{job.get('owner', '-')} in {job.get('tenant', '-')}")]
    rows += [(label, local_time(job.get(f"{label}_at"))) for label in ("created", "admitted", "started", "finished")]
    if job.get("elastic"):
        rows.append(("elastic", elastic_line(job["elastic"])))
    metrics = job.get("latest_metrics") or {}
    if metrics:
        rows.append(("metrics", ", ".join(f"{name} {number(point.get('value'))} (step {point.get('step')})"
                                          for name, point in sorted(metrics.items()))))
    if job.get("page_url"):
        rows.append(("page", urljoin(base_url + "/", job["page_url"])))
    lines = [f"{job.get('id')}  {job.get('name', '')}".rstrip()]
    lines += [f"  {label:<10} {value}" for label, value in rows]
    return "\n".join(lines)


def elastic_line(elastic):
    """`2 of 1–4 learners, batch 256 (128 each, lr ×1), lr scaling linear`."""
    text = f"{elastic.get('learners')} of {elastic.get('min_learners')}–{elastic.get('max_learners')} learners"
    if elastic.get("global_batch") is not None:
        text += (f", batch {elastic['global_batch']} ({elastic.get('local_batch')} each, "
                 f"lr ×{number(elastic.get('lr_scale'))})")
    return text + f", lr scaling {elastic.get('lr_scaling', 'linear')}"


ALLOCATION_HEADERS = ("ATTEMPT", "LEARNERS", "BATCH", "LR×", "SAMPLES/S", "RESIZE", "STARTED", "REASON")


def render_allocations(rows):
    """The allocation timeline `trainyard show` prints for an elastic job: one line per attempt. The open
    stretch has no throughput yet (it is measured when the stretch ends)."""
    def batch(row):
        if row.get("global_batch") is None:
            return "-"
        return f"{row['global_batch']} ({row.get('local_batch')} each)"

    def throughput(row):
        if row.get("samples_per_s") is not None:
            return f"{row['samples_per_s']:,.1f}"
        if not row.get("started_at"):
            if row.get("kind") != "batch":
                return "-"
            return "withdrawn" if row.get("ended_at") else "asked"
        return "running" if not row.get("ended_at") else "-"

    def cost(row):
        return "-" if row.get("resize_cost_s") is None else f"{row['resize_cost_s']:.1f}s"

    table = [(row.get("attempt"), row.get("learners"), batch(row), number(row.get("lr_scale")), throughput(row),
              cost(row), local_time(row.get("started_at")), row.get("reason") or "") for row in rows]
    return "\n".join(["allocations"] + ["  " + line for line in table_lines(ALLOCATION_HEADERS, table)])


MAX_CELL = 48  # a table cell in `trainyard compare`: long commands are cut here (--json has them whole)
# Rows the server reads out of the command line: when one of them differs, the command row is left out.
COMMAND_PARTS = ("learning_rate", "batch_size", "flag:", "env:")


def comparison_rows(comparison):
    """`trainyard compare`'s table as (headers, rows): one column per job, the facts that differ, then
    each metric's final value; and the line of facts they share."""
    jobs = comparison.get("jobs") or []
    headers = ("", *(job.get("id", "?") for job in jobs))
    rows = [("name", *(job.get("name", "") for job in jobs))]
    differ = comparison.get("rows") or []
    if any(row.get("key", "").startswith(COMMAND_PARTS) for row in differ):  # the command adds only width
        differ = [row for row in differ if row.get("key") != "command"]
    rows += [(row.get("label", ""), *(_cell(value) for value in row.get("values") or [])) for row in differ]
    rows += [(f"final {metric.get('name')}", *("-" if value is None else number(float(value))
                                               for value in metric.get("final") or []))
             for metric in comparison.get("metrics") or []]
    same = [f"{fact.get('label')} {_cell(fact.get('value'))}" for fact in comparison.get("same") or []
            if fact.get("key") != "command"]
    return headers, rows, ("same in all: " + ", ".join(same)) if same else ""


def _cell(value):
    text = "-" if value in (None, "") else " ".join(str(value).split())
    return text if len(text) <= MAX_CELL else text[:MAX_CELL - 1] + "…"


def final_message(job):
    status = job.get("status")
    text = f"{job.get('id')} {status}"
    if job.get("status_reason"):
        text += f": {job['status_reason']}"
    if job.get("exit_code") not in (None, 0) and f"code {job['exit_code']}" not in str(job.get("status_reason")):
        text += f" (exit code {job['exit_code']})"
    if status in RESTING_STATUSES:
        text += f"; `trainyard resume {job.get('id')}` continues it"
    return text
