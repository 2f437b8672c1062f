"""A hostile learner tries to fill the disk every tenant and the database live on.

Each job asks for small caps in its manifest's `disk` block (20 MiB, so the tests take seconds and
never fill this machine); the learner writes far past them. The job must end FAILED naming the
folder and the cap, what it wrote must stay near the cap, and its work folder must be gone.
"""
import io
import os
import tarfile

import pytest

from tests.support.harness import EXAMPLES
from tests.support.hostile import HOSTILE, log_lines

pytestmark = pytest.mark.e2e
MiB = 2**20
CAP = 20 * MiB
# What a learner writing at full speed can add past a cap between two measurements of the agent's
# watchdog (learner_agent.diskwatch: every 0.25 s once past half the cap) and the kill, on a loaded
# 2-core machine where the watchdog waits for a core too (it wrote 232 MiB past one there). Well
# under the 1,000 MiB the learner asks to write, so the kill is still what stops it.
OVERSHOOT = 400 * MiB


def submit_with_disk(platform, command, disk):
    """A hostile job (tests/security/jobs/hostile) running `command` with the manifest's `disk` block."""
    manifest = (HOSTILE / "manifest.yml").read_text().replace("command: python3 escape.py", f"command: {command}")
    manifest += "disk: {" + ", ".join(f"{name}: {value}" for name, value in disk.items()) + "}\n"
    return platform.submit(os.path.relpath(HOSTILE, EXAMPLES), manifest_text=manifest)


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


@pytest.mark.parametrize("folder", ["results", "checkpoints", "work"])
def test_a_learner_filling_a_folder_past_its_cap_is_killed_and_the_job_fails_naming_it(platform, folder):
    job = submit_with_disk(platform, f"python3 disk_fill.py {folder} 1000", {folder: "20MiB"})
    final = platform.wait_for(job["id"], timeout=120)
    lines = log_lines(platform, job["id"], "DISKFILL")
    assert final["status"] == "FAILED", (final, lines[-3:])
    assert f"disk cap: the {folder} folder used " in final["status_reason"], final
    assert "over its cap of 20.0MiB" in final["status_reason"], final
    assert not any("wrote all" in line for line in lines), lines[-3:]
    job_dir = platform.data_dir / "storage" / "team-a" / job["id"]
    learner_dir = job_dir / "attempt-1" / "learner-0"
    where = {"results": job_dir / "results", "checkpoints": job_dir / "checkpoints"}.get(folder)
    if where is not None:
        written = folder_bytes(where)
        print(f"{folder}: {written / MiB:.0f} MiB written against a 20 MiB cap")
        assert CAP < written < CAP + OVERSHOOT
    else:  # the work folder goes with the attempt
        assert not (learner_dir / "work").exists()
        assert not (learner_dir / "state").exists()


def test_a_flood_of_lines_stops_at_the_jobs_log_line_cap_and_is_counted(platform):
    job = submit_with_disk(platform, "python3 log_flood.py 5000 100", {"log_lines": 200})
    final = platform.wait_for(job["id"], timeout=120)
    assert final["status"] == "COMPLETED", final
    lines = platform.all_logs(job["id"])
    flood = [line for line in lines if line["line"].startswith("FLOOD ")]
    notices = [line["line"] for line in lines if line["stream"] == "system"]
    assert len(flood) <= 200 and len(lines) <= 202, len(lines)
    assert any("log cap reached for learner 0" in notice for notice in notices), notices
    assert any(" not stored: log cap reached" in notice for notice in notices), notices
    assert final["log_dropped_lines"] >= 5000 - 200, final
    stored_log = platform.data_dir / "storage" / "team-a" / job["id"] / "logs" / "training.log"
    assert len(stored_log.read_text().splitlines()) == len(lines)


def test_long_lines_are_cut_and_stop_at_the_jobs_log_byte_cap(platform):
    job = submit_with_disk(platform, "python3 log_flood.py 400 60000", {"logs": "1MiB"})
    final = platform.wait_for(job["id"], timeout=120)
    assert final["status"] == "COMPLETED", final
    lines = platform.all_logs(job["id"])
    flood = [line["line"] for line in lines if line["line"].startswith("FLOOD ")]
    assert flood and all("…[line cut: 60000 bytes" in line and len(line.encode()) < 17000 for line in flood)
    # Counted as stored would have been: each cut to the 16 KiB line limit first.
    assert final["log_bytes"] <= MiB + 4096 and final["log_dropped_bytes"] > 4 * MiB, final
    stored_log = platform.data_dir / "storage" / "team-a" / job["id"] / "logs" / "training.log"
    assert stored_log.stat().st_size <= MiB + 4096 + 1000


def test_code_that_unpacks_past_the_work_cap_is_not_run(platform):
    manifest = (HOSTILE / "manifest.yml").read_text().replace("command: python3 escape.py", "command: python3 bomb.py")
    manifest += "disk: {work: 20MiB}\n"
    response = platform.api("POST", "/api/v1/jobs/", files={"manifest": ("manifest.yml", manifest),
                                                           "code": ("code.tar.gz", _archive(30 * MiB))})
    assert response.status_code == 201, response.text  # 30 MiB is within what a submit may declare
    job = response.json()
    final = platform.wait_for(job["id"], timeout=120)
    assert final["status"] == "FAILED", final
    assert ("did not start: disk cap: the code archive unpacks to more than the work folder's cap of 20.0MiB"
            in final["status_reason"]), final
    assert not log_lines(platform, job["id"], "BOMB ran")
    learner_dir = platform.data_dir / "storage" / "team-a" / job["id"] / "attempt-1" / "learner-0"
    assert not (learner_dir / "work").exists()
    assert not list(learner_dir.glob(".work.*"))


def _archive(size):
    """A .tar.gz of `size` random bytes (it does not compress: no bomb the submit would refuse) and a
    script that would say it ran."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        for name, data in (("bomb.py", b"print('BOMB ran', flush=True)\n"), ("noise.bin", os.urandom(size))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()
