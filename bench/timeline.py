"""timeline: where a job's fixed cost goes, phase by phase, from what the platform left behind.

Not a benchmark of its own (excluded from `bench all`): the overhead and concurrency benches call
`job_timeline` after a run. Each stamp is read from where the platform records it — the database
of the session (SQLite, the embedded default) and the files the local backend and the learner
agent write in the learner's folder — so nothing is instrumented for the bench. Times are Unix
seconds; consecutive stamps give one phase each.
"""
import json
import sqlite3
from datetime import datetime, timezone
from pathlib import Path

# (phase name, stamp it ends at); each phase starts where the one before ended.
START_PHASES = (
    ("submit → created (HTTP, stored)", "created"),
    ("created → admitted (scheduling cycle)", "admitted"),
    ("admitted → deploy claimed (worker woken)", "deploy_claimed"),
    ("deploy claimed → agent config written", "agent_config"),
    ("agent config → agent running (process start-ups)", "agent_running"),
    ("agent running → command started (unpack, sandbox)", "command_started"),
    ("command started → first line", "first_line"),
)
END_PHASES = (
    ("last line → exit written (agent)", "exit_written"),
    ("exit written → exit recorded (ingest)", "exit_recorded"),
    ("exit recorded → STORING (worker woken)", "storing"),
    ("STORING → COMPLETED (results stored)", "completed"),
    ("COMPLETED → the client knows (Client.wait)", "seen"),
)


def _epoch(value):
    """A datetime as Django keeps it in SQLite ('YYYY-MM-DD HH:MM:SS[.ffffff]', UTC) → Unix seconds."""
    if value is None:
        return None
    moment = datetime.fromisoformat(value)
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()


def _mtime(path):
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def job_timeline(data_dir, tenant, job_id, *, submitted_at, seen_at=None):
    """{stamp: Unix seconds} for the first attempt's learner 0 of `job_id`; `submitted_at` is the
    client's clock just before the POST and `seen_at` when its wait returned (the same machine's
    clock as every other stamp)."""
    data_dir = Path(data_dir)
    db = sqlite3.connect(f"file:{data_dir / 'trainyard.sqlite3'}?mode=ro", uri=True, timeout=30)
    try:
        created, = db.execute("SELECT created_at FROM jobs_job WHERE id = ?", [job_id]).fetchone()
        events = dict(db.execute("SELECT to_status, MIN(time) FROM jobs_jobevent WHERE job_id = ? AND attempt = 1 "
                                 "GROUP BY to_status", [job_id]).fetchall())
        follow_ups = {kind: (created_row, claimed) for kind, created_row, claimed in db.execute(
            "SELECT kind, created, claimed_at FROM jobs_followup WHERE job_id = ? AND attempt = 1", [job_id])}
        first, last = db.execute("SELECT MIN(time), MAX(time) FROM jobs_logline WHERE job_id = ? AND attempt = 1 "
                                 "AND learner = 0 AND stream != 'system'", [job_id]).fetchone()
    finally:
        db.close()
    folder = data_dir / "storage" / tenant / job_id / "attempt-1" / "learner-0"
    try:
        exit_written = json.loads((folder / "exit.json").read_text()).get("finished_at")
    except (OSError, ValueError):
        exit_written = None
    agent_config = _mtime(folder / "agent.json")
    deploy_claimed = _epoch(follow_ups.get("deploy", (None, None))[1])
    if deploy_claimed is not None and agent_config is not None:
        # A claim is renewed every few seconds while the work runs: the first claim is never later
        # than the config the deploy wrote.
        deploy_claimed = min(deploy_claimed, agent_config)
    return {
        "submitted": submitted_at,
        "created": _epoch(created),
        "admitted": _epoch(events.get("PENDING")),
        "deploy_claimed": deploy_claimed,
        "agent_config": agent_config,
        "agent_running": _mtime(folder / "agent.pid"),
        "command_started": _mtime(folder / "learner.pid"),
        "first_line": _iso_epoch(first),
        "last_line": _iso_epoch(last),
        "exit_written": exit_written,
        "exit_recorded": _epoch(follow_ups.get("finish", (None, None))[0]),
        "storing": _epoch(events.get("STORING")),
        "completed": _epoch(events.get("COMPLETED")),
        "seen": seen_at,
    }


def _iso_epoch(value):
    return _epoch(value.replace("T", " ").split("+")[0]) if value else None


def phases(stamps):
    """[(phase, seconds)] for the start and the end of the job (None where a stamp is missing)."""
    out = []
    for start, table in (("submitted", START_PHASES), ("last_line", END_PHASES)):
        before = stamps.get(start)
        for name, stamp in table:
            now = stamps.get(stamp)
            out.append((name, None if before is None or now is None else now - before))
            before = now
    return out


def summarise(timelines):
    """{phase: median seconds} over several jobs' stamps, plus the two totals."""
    from bench.report import median
    names = [name for name, _ in START_PHASES + END_PHASES]
    per_phase = {name: [] for name in names}
    for stamps in timelines:
        for name, seconds in phases(stamps):
            if seconds is not None:
                per_phase[name].append(seconds)
    summary = {name: round(median(values), 4) for name, values in per_phase.items() if values}
    totals = {"submit_to_first_line_s": [t["first_line"] - t["submitted"] for t in timelines
                                         if t.get("first_line") and t.get("submitted")],
              "last_line_to_completed_s": [t["completed"] - t["last_line"] for t in timelines
                                           if t.get("completed") and t.get("last_line")]}
    summary.update({key: round(median(values), 4) for key, values in totals.items() if values})
    return summary


def rows(summary):
    """publish() rows for a summarise() result: the two totals, each followed by its phases."""
    out = []
    for total, table in (("submit_to_first_line_s", START_PHASES), ("last_line_to_completed_s", END_PHASES)):
        if total in summary:
            out.append((f"{total} (median)", summary[total], ""))
        out += [(f"  {name}", summary[name], "") for name, _ in table if name in summary]
    return out
