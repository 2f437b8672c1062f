"""The web edge of the real platform, probed as a hostile researcher (or a hostile web page) would:
open websockets that outlive their access, foreign Origins and Hosts, floods of logins, tokens and
ingest posts, script injection the Content-Security-Policy must stop; and `make demo`, which must
leave nothing running whichever signal stops it."""
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest
import requests
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from portal.runner import PROJECT_ROOT, free_port, migrate, port_is_free
from tests.support import browser as chromium
from tests.support.optional import skip_or_fail
from trainyard.packing import code_upload

pytestmark = pytest.mark.e2e


def ws_url(platform, path):
    return platform.url.replace("http://", "ws://") + path


def close_code_within(socket, seconds):
    """The code the server closes `socket` with, reading (and dropping) messages meanwhile; None if
    it is still open after `seconds`."""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            try:
                socket.recv(timeout=max(0.05, deadline - time.monotonic()))
            except TimeoutError:
                return None
    except ConnectionClosed as closed:
        return closed.rcvd.code if closed.rcvd else None
    return None


def submit_private(platform):
    folder = PROJECT_ROOT / "examples" / "custom-shell"
    code = code_upload(str(folder))
    with code.fileobj:
        response = platform.api("POST", "/api/v1/jobs/", data={"private": "true"}, files={
            "manifest": ("manifest.yml", (folder / "manifest.yml").read_text()),
            "code": (code.filename, code.fileobj.read())})
    assert response.status_code == 201, response.text
    assert response.json()["private"] is True
    return response.json()


@pytest.fixture(scope="module")
def quiet_job(platform):
    """A job of alice's (team-a) to watch; what it does does not matter."""
    return platform.submit("custom-shell")


# --- websockets outlive nothing they were granted ---------------------------------------------------
def test_a_revoked_token_closes_its_open_job_socket(platform, quiet_job):
    created = platform.api("POST", "/api/v1/tokens/", json={"name": "websocket"})
    assert created.status_code == 201, created.text
    with connect(ws_url(platform, f"/ws/jobs/{quiet_job['id']}/?token={created.json()['key']}")) as socket:
        assert json.loads(socket.recv(timeout=10))["type"] == "job"
        revoked = platform.api("DELETE", f"/api/v1/tokens/{created.json()['id']}/")
        assert revoked.status_code == 200, revoked.text
        assert close_code_within(socket, 5) == 4401


def test_an_unshared_private_job_closes_its_open_socket(platform, intruder):
    bob_token = platform.add_member(platform.tenant, "bob-ws")
    secret = submit_private(platform)
    shared = platform.api("POST", f"/api/v1/jobs/{secret['id']}/share/", json={"username": "bob-ws", "access": "view"})
    assert shared.status_code == 200, shared.text
    with connect(ws_url(platform, f"/ws/jobs/{secret['id']}/?token={bob_token}")) as socket:
        socket.recv(timeout=10)
        unshared = platform.api("DELETE", f"/api/v1/jobs/{secret['id']}/share/bob-ws/")
        assert unshared.status_code in (200, 204), unshared.text
        assert close_code_within(socket, 5) == 4404


def test_a_waiting_scripts_socket_names_no_other_tenants_job_whatever_it_waits_until(platform, quiet_job, intruder):
    # `until` only chooses which changes carry the job's detail: it opens nothing.
    _, _, mallory = intruder
    hostile = ",".join(["COMPLETED", "'; DROP TABLE jobs_job; --", "<script>", "x" * 2000])
    path = f"/ws/jobs/{quiet_job['id']}/?only=status&until={urllib.parse.quote(hostile)}"
    with connect(ws_url(platform, f"{path}&token={mallory}")) as foreign:
        with pytest.raises(ConnectionClosed) as closed:  # nothing is sent before the close
            foreign.recv(timeout=5)
        assert closed.value.rcvd.code == 4404  # as for any other tenant's job
    with connect(ws_url(platform, f"{path}&token={platform.token}")) as own:
        first = json.loads(own.recv(timeout=10))
        assert first["type"] == "job" and first["job"]["id"] == quiet_job["id"]


def test_a_websocket_from_a_foreign_origin_is_refused(platform, quiet_job):
    path = f"/ws/jobs/{quiet_job['id']}/?token={platform.token}"
    with pytest.raises(InvalidStatus) as refused:
        connect(ws_url(platform, path), origin="http://evil.example")
    assert refused.value.response.status_code == 403
    with connect(ws_url(platform, path), origin=platform.url) as own_page:  # the portal's own pages
        assert json.loads(own_page.recv(timeout=10))["type"] == "job"
    with connect(ws_url(platform, path)) as script:  # the CLI and scripts send no Origin
        assert json.loads(script.recv(timeout=10))["type"] == "job"


def test_a_host_the_platform_was_not_given_is_refused(platform):
    response = requests.get(platform.url + "/login/", headers={"Host": "evil.example"}, timeout=10)
    assert response.status_code == 400
    assert requests.get(platform.url + "/login/", timeout=10).status_code == 200


# --- the Content-Security-Policy -------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    if not chromium.chromium_found():
        skip_or_fail(f"Chromium not found at {chromium.CHROMIUM}")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as playwright:
        instance = chromium.launch(playwright)
        yield instance
        instance.close()


PAGES = ["/", "/submit/", "/experiments/", "/experiments/new/", "/tenant/", "/cluster/", "/tenant/members/", "/account/tokens/",
         "/api/docs/"]


def test_every_page_carries_a_csp_and_breaks_none_of_it(platform, browser, quiet_job):
    page = chromium.log_in(browser, platform.url, platform.username, platform.password, timeout_ms=60_000)
    violations = []
    page.on("console", lambda message: "Content Security Policy" in message.text and violations.append(
        f"{page.url}: {message.text}"))
    page.on("pageerror", lambda error: violations.append(f"{page.url}: {error}"))
    for path in [*PAGES, f"/jobs/{quiet_job['id']}/"]:
        response = page.goto(platform.url + path)
        policy = response.headers.get("content-security-policy", "")
        assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy, (path, policy)
        page.wait_for_load_state("networkidle")
    assert page.locator("[data-testid=log]").count() == 1  # the job page's scripts ran and built it
    assert violations == []


def test_the_admin_console_breaks_none_of_the_csp(platform, browser):
    platform.manage("createsuperuser", "--noinput", "--username", "root-csp", "--email", "root@example.org",
                    env={"DJANGO_SUPERUSER_PASSWORD": "root-csp-password"})
    page = browser.new_page()
    violations = []
    page.on("console", lambda message: "Content Security Policy" in message.text and violations.append(
        f"{page.url}: {message.text}"))
    page.goto(platform.url + "/admin/login/")
    page.fill("#id_username", "root-csp")
    page.fill("#id_password", "root-csp-password")
    page.click("input[type=submit]")
    page.wait_for_url(platform.url + "/admin/")
    for path in ["/admin/", "/admin/tenants/tenant/", "/admin/tenants/tenant/1/change/", "/admin/jobs/job/",
                 "/admin/tenants/membership/add/", "/admin/auth/user/add/"]:
        assert page.goto(platform.url + path).status == 200, path
        page.wait_for_load_state("networkidle")
    assert violations == []


def test_an_injected_inline_script_does_not_run(platform, browser):
    page = chromium.log_in(browser, platform.url, platform.username, platform.password, timeout_ms=60_000)
    refused = []
    page.on("console", lambda message: "Content Security Policy" in message.text and refused.append(message.text))
    page.goto(platform.url + "/")
    # What a name or log line that slipped through escaping would do: add a script or a handler.
    page.evaluate("""() => {
        const script = document.createElement("script");
        script.textContent = "window.injected = 1";
        document.body.append(script);
        const img = document.createElement("img");
        img.setAttribute("onerror", "window.injected = 2");
        img.src = "/nowhere.png";
        document.body.append(img);
    }""")
    page.wait_for_timeout(500)
    assert page.evaluate("window.injected") is None
    assert refused


# --- floods from one address: each test speaks from its own loopback address ------------------------
def from_address(platform, address, method, path, *, body=b"", headers=None):
    """One HTTP request to the platform from `address` (any 127.x.y.z reaches it), so a lockout
    here never touches the other tests, which speak from 127.0.0.1."""
    port = int(platform.url.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=(address, 0))
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.headers, response.read()  # headers: case-insensitive
    finally:
        connection.close()


def sign_in(platform, address, username, password):
    status, headers, page = from_address(platform, address, "GET", "/login/")
    csrf = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1).decode()
    cookie = re.search(r"csrftoken=([^;]+)", headers["Set-Cookie"]).group(1)
    body = urllib.parse.urlencode({"username": username, "password": password, "csrfmiddlewaretoken": csrf})
    return from_address(platform, address, "POST", "/login/", body=body.encode(), headers={
        "Content-Type": "application/x-www-form-urlencoded", "Cookie": f"csrftoken={cookie}"})


def test_guessing_a_password_locks_that_username_from_that_address(platform):
    platform.add_member(platform.tenant, "carol-login", password="carols-password")
    assert [sign_in(platform, "127.0.0.2", "carol-login", "guess")[0] for _ in range(5)] == [200] * 4 + [429]
    status, headers, page = sign_in(platform, "127.0.0.2", "carol-login", "carols-password")
    assert status == 429 and int(headers["Retry-After"]) > 60 and b"Too many failed sign-ins" in page
    assert sign_in(platform, "127.0.0.3", "carol-login", "carols-password")[0] == 302  # carol, elsewhere


def test_a_flood_of_bad_tokens_gets_429(platform):
    for _ in range(30):
        assert from_address(platform, "127.0.0.4", "GET", "/api/v1/jobs/",
                            headers={"Authorization": "Token ty_guess"})[0] == 401
    status, headers, _ = from_address(platform, "127.0.0.4", "GET", "/api/v1/jobs/",
                                      headers={"Authorization": f"Token {platform.token}"})
    assert status == 429 and int(headers["Retry-After"]) > 0


def test_a_flood_of_forged_ingest_credentials_gets_429(platform, quiet_job):
    path = f"/api/v1/ingest/{quiet_job['id']}/"
    forged = {"Authorization": "Ingest forged", "Content-Type": "application/json"}
    for _ in range(20):
        assert from_address(platform, "127.0.0.5", "POST", path, body=b"{}", headers=forged)[0] in (401, 404)
    status, headers, _ = from_address(platform, "127.0.0.5", "POST", path, body=b"{}", headers=forged)
    assert status == 429 and int(headers["Retry-After"]) > 0


def test_the_ingest_route_refuses_a_host_the_platform_was_not_given(platform, quiet_job):
    """Agents' posts skip Django's middleware (portal.overrides.ingest), not its Host check."""
    path = f"/api/v1/ingest/{quiet_job['id']}/"
    for host in ("evil.example", "127.0.0.1.evil.example"):
        status, _, _ = from_address(platform, "127.0.0.6", "POST", path, body=b"{}", headers={
            "Host": host, "Authorization": "Ingest forged", "Content-Type": "application/json"})
        assert status == 400, host


# --- `make demo` stops everything it started ---------------------------------------------------------
def processes_of(data_dir):
    """pids of every process running with this TRAINYARD_DATA_DIR (Redis, uvicorn, the worker and
    its pool, beat, learner agents: all inherit the demo's environment)."""
    marker = f"TRAINYARD_DATA_DIR={data_dir}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def wait_until(predicate, timeout, poll=0.2):
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(poll)
    return value


@pytest.mark.parametrize("sig, when", [(signal.SIGTERM, "running"), (signal.SIGHUP, "running"),
                                       (signal.SIGTERM, "starting")])
def test_make_demo_stops_everything_it_started(tmp_path, sig, when):
    data_dir = tmp_path.resolve()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(TRAINYARD_DATA_DIR=str(data_dir), TRAINYARD_PORT=str(port), TRAINYARD_DEMO_EXAMPLES="none",
               DJANGO_SETTINGS_MODULE="portal.settings")
    migrate(env)
    log = open(tmp_path / "demo.out", "wb")
    # Its own session, like a shell job: the signal reaches the demo alone, as `kill` or make sends it.
    demo = subprocess.Popen([sys.executable, "manage.py", "demo"], cwd=PROJECT_ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        if when == "running":
            assert wait_until(lambda: b"Trainyard is running" in (tmp_path / "demo.out").read_bytes(), 120), \
                (tmp_path / "demo.out").read_text()
        else:  # the web server is starting: the demo is inside the platform's start-up
            assert wait_until(lambda: any(b"uvicorn" in cmdline(pid) for pid in processes_of(data_dir)), 120), \
                (tmp_path / "demo.out").read_text()
        started = processes_of(data_dir)
        assert len(started) >= (5 if when == "running" else 2), started  # redis, web, worker (+pool), beat
        demo.send_signal(sig)
        demo.wait(60)
        left = wait_until(lambda: not processes_of(data_dir), 30) or processes_of(data_dir)
        assert left is True, f"still running after {signal.Signals(sig).name}: {left}"
        assert port_is_free(port)
    finally:
        for pid in processes_of(data_dir):
            os.kill(pid, signal.SIGKILL)
        if demo.poll() is None:
            demo.kill()
