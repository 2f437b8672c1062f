"""Submit a job with the Python SDK, follow its log as it runs, and print its final metrics.

    export TRAINYARD_URL=http://127.0.0.1:8000 TRAINYARD_TOKEN=...   # or `trainyard login`
    python examples/sdk/submit_and_follow.py                   # examples/pytorch-digits
    python examples/sdk/submit_and_follow.py examples/custom-shell

Exits 0 when the job completed, 1 when it did not (or the platform said no).
"""
import sys
from pathlib import Path

from trainyard import Client, TrainyardError

EXAMPLES = Path(__file__).resolve().parent.parent


def main(folder):
    client = Client()
    job = client.submit(folder / "manifest.yml", folder)
    print(f"submitted {job['id']} ({job['status']})", flush=True)
    for line in client.logs(job["id"], follow=True):
        print(f"  | {line['line']}", flush=True)
    job = client.wait(job["id"])
    print(f"{job['id']} {job['status']} {job.get('status_reason') or ''}".rstrip())
    for name, point in sorted((job.get("latest_metrics") or {}).items()):
        print(f"  {name} = {point['value']:.4g} (step {point['step']})")
    return 0 if job["status"] == "COMPLETED" else 1


if __name__ == "__main__":
    try:
        sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else EXAMPLES / "pytorch-digits"))
    except TrainyardError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
