"""The hostile job (tests/security/jobs/hostile) submitted to a running platform, and what it printed;
shared by the security suite's modules."""
import os

from portal.runner import PROJECT_ROOT
from tests.support.harness import EXAMPLES


HOSTILE = PROJECT_ROOT / "tests" / "security" / "jobs" / "hostile"


def submit_hostile(platform, command, *, token=None, cpus=0.5, memory="256MiB"):
    manifest = (HOSTILE / "manifest.yml").read_text()
    manifest = manifest.replace("command: python3 escape.py", f"command: {command}")
    manifest = manifest.replace("cpus: 0.5", f"cpus: {cpus}").replace("memory: 256MiB", f"memory: {memory}")
    return platform.submit(os.path.relpath(HOSTILE, EXAMPLES), manifest_text=manifest, token=token)


def log_lines(platform, job_id, prefix):
    return [line["line"] for line in platform.all_logs(job_id) if line["line"].startswith(prefix)]
