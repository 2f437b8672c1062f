"""Jobs for a running platform (tests.support.harness) beyond its examples as they stand: an example
with another command, code from any folder, and the metrics a job recorded."""
import re

from tests.support.harness import EXAMPLES
from trainyard.packing import code_upload


def manifest_with_command(example, command):
    text = (EXAMPLES / example / "manifest.yml").read_text()
    return re.sub(r"(?m)^  command: .*$", f"  command: {command}", text) if command else text


def metrics_of(platform, job_id):
    return platform.api("GET", f"/api/v1/jobs/{job_id}/metrics/").json()["results"]


def submit_folder(platform, folder, manifest_text):
    """Submit code from any folder (the harness submits examples/<name> only)."""
    code = code_upload(str(folder))
    with code.fileobj:
        response = platform.api("POST", "/api/v1/jobs/", files={
            "manifest": ("manifest.yml", manifest_text), "code": (code.filename, code.fileobj.read())})
    assert response.status_code == 201, response.text
    return response.json()
