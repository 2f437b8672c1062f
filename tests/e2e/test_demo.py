"""`make demo` from a fresh data directory, as a new user runs it: nothing but Python (SQLite and the
embedded Redis), its output free of tracebacks, and a `manage.py` command run beside it reaching
the same Redis and database (the quota it changes wakes the running scheduler)."""
import json
import os
import subprocess
import sys

import pytest
import requests

from portal.runner import PROJECT_ROOT, free_port
from tests.support.demo import Demo

pytestmark = pytest.mark.e2e


def test_the_demo_starts_and_stops_clean_and_commands_beside_it_reach_its_redis(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "TRAINYARD_EMBEDDED_REDIS_PORT")}
    env.update(TRAINYARD_DATA_DIR=str(data_dir), TRAINYARD_DEMO_EXAMPLES="custom-shell")
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=PROJECT_ROOT, env=env,
                   check=True, timeout=300)
    demo = Demo(data_dir, env)
    port = free_port()
    try:
        demo.start(port)
        facts = json.loads((data_dir / "demo.json").read_text())
        assert facts["redis_url"].startswith("redis://127.0.0.1:") and facts["database_url"].startswith("sqlite:")
        signed_in = requests.Session()
        login_page = signed_in.get(facts["url"] + "/login/", timeout=30)
        answer = signed_in.post(facts["url"] + "/login/", timeout=30, headers={"Referer": facts["url"] + "/login/"},
                                data={"username": facts["tenant_admin_username"], "password": facts["password"],
                                      "csrfmiddlewaretoken": login_page.cookies.get("csrftoken", "")})
        members = signed_in.get(facts["url"] + "/tenant/members/", timeout=30).text
        assert answer.ok and "your role: admin" in members  # the demo's tenant admin can try members and invitations
        beside = subprocess.run([sys.executable, "manage.py", "tenant", "create", "team-beside", "--jobs", "3"],
                                cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert beside.returncode == 0, beside.stderr
        assert "could not" not in beside.stderr, beside.stderr  # e.g. wake the scheduling loop
    finally:
        demo.interrupt()
    output = (data_dir / f"demo-{port}.out").read_text(errors="replace")
    assert "Trainyard is running." in output and output.rstrip().endswith("Stopped.")
    assert "Traceback" not in output and "could not publish" not in output, output
    assert not (data_dir / "embedded-redis.port").exists()  # a stopped demo's port is no one's
