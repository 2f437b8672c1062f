"""The runner's handling of the platform's processes, with `sleep` standing in for each part."""
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from portal.runner import Platform, StartupError, free_port


class Sleepers(Platform):
    def start_redis(self):
        self.spawn("redis", ["sleep", "60"])

    def start_web(self, name="web"):
        self.spawn(name, ["sleep", "60"])

    def start_worker(self):
        self.spawn("worker", ["sleep", "60"])

    def start_beat(self):
        self.spawn("beat", ["sleep", "60"])

    def start_scheduler(self, name="scheduler"):
        self.spawn(name, ["sleep", "60"])

    def start_webhooks(self):
        self.spawn("webhooks", ["sleep", "60"])

    def wait_ready(self, timeout):
        pass


@pytest.fixture
def platform(tmp_path, request):
    started = Sleepers(data_dir=tmp_path, port=free_port(), env={"REDIS_URL": ""},
                       supervise=getattr(request, "param", True)).start()
    yield started
    started.stop()


def wait_for(predicate, timeout=5):
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def test_it_starts_a_crashed_part_again(platform):
    crashed = platform.pids()["worker"]
    os.kill(crashed, signal.SIGKILL)
    assert wait_for(lambda: platform.pids().get("worker") not in (None, crashed))
    assert [(part, code) for part, code, _ in platform.restarts] == [("worker", -9)]
    assert "worker exited with code -9; starting it again" in (platform.log_dir / "worker.log").read_text()
    platform.check_alive("worker")


def test_a_second_scheduler_and_the_webhooks_worker_are_started_again_as_themselves(platform):
    started = []
    for kind in ("web", "scheduler", "webhooks"):
        start = getattr(platform, f"start_{kind}")
        setattr(platform, f"start_{kind}", lambda *name, kind=kind, start=start: started.append((kind, *name)) or
                start(*name))
    platform.start_scheduler("scheduler2")  # a standby beside the first
    started.clear()
    for part in ("scheduler2", "webhooks"):
        crashed = platform.pids()[part]
        os.kill(crashed, signal.SIGKILL)
        assert wait_for(lambda: platform.pids().get(part) not in (None, crashed))
    assert started == [("scheduler", "scheduler2"), ("webhooks",)]


def test_a_part_stopped_on_purpose_stays_down_until_started(platform):
    platform.kill("beat")
    time.sleep(1.2)  # two supervisor rounds
    assert "beat" not in platform.pids() and not platform.restarts
    platform.start_beat()
    assert "beat" in platform.pids()


def test_a_crash_looping_part_is_left_down_and_reported(platform, monkeypatch):
    monkeypatch.setattr("portal.runner.RESTARTS_PER_MINUTE", 2)
    for _ in range(3):
        pid = wait_for(lambda: platform.pids().get("web"))
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: platform.pids().get("web") != pid)
    time.sleep(1.2)
    assert "web" not in platform.pids() and len(platform.restarts) == 2
    with pytest.raises(StartupError, match="web exited with code -9"):
        platform.check_alive("web")


class SlowToRestartWeb(Sleepers):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.restarting = threading.Event()

    def start_web(self, name="web"):
        if self.restarts:
            self.restarting.set()
            time.sleep(0.5)  # the supervisor holds the part's slot empty meanwhile
        super().start_web(name)


class SlowToAnswer:
    """A part whose poll() takes a while when the test asks, so a reader is mid-iteration."""
    pid = 0

    def poll(self):
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.6)
        return None


def test_reading_the_parts_while_the_supervisor_restarts_one_sees_a_consistent_set(tmp_path):
    platform = SlowToRestartWeb(data_dir=tmp_path, port=free_port(), env={"REDIS_URL": ""},
                               supervise=True).start()
    try:
        with platform._lock:
            platform.processes["probe"] = SlowToAnswer()
        crashed = platform.pids()["web"]
        os.kill(crashed, signal.SIGKILL)
        assert platform.restarting.wait(10)
        # Mid-restart: the web slot is empty, and is filled while pids() waits on the probe.
        assert platform.pids()["web"] != crashed
    finally:
        with platform._lock:
            platform.processes.pop("probe", None)
        platform.stop()


@pytest.mark.parametrize("platform", [False], indirect=True)
def test_unsupervised_a_crash_is_reported_and_left_alone(platform):
    process = platform.processes["redis"]
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    with pytest.raises(StartupError, match="redis exited with code -9"):
        platform.check_alive("redis")
    time.sleep(0.6)
    assert "redis" not in platform.pids() and not platform.restarts


class WebOnly(Sleepers):
    """The real web processes (uvicorn), the rest sleeping."""
    start_web = Platform.start_web

    def wait_ready(self, timeout):
        assert wait_for(lambda: served(self.url), timeout)


def served(url):
    try:
        with urllib.request.urlopen(url + "/login/", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code  # answered all the same
    except OSError:
        return None


def test_two_web_processes_share_the_port_and_one_serves_while_the_other_restarts(tmp_path):
    platform = WebOnly(data_dir=tmp_path, port=free_port(), supervise=True,
                       env={"REDIS_URL": "", "TRAINYARD_WEB_PROCESSES": "2"}).start(timeout=60)
    try:
        first, second = platform.pids()["web"], platform.pids()["web2"]
        killed = platform.processes["web"]
        os.kill(first, signal.SIGKILL)
        killed.wait(5)
        # Nothing listens on the port but the socket both were given: the second answers alone.
        assert all(served(platform.url) for _ in range(20))
        assert wait_for(lambda: platform.pids().get("web") not in (None, first), timeout=10)
        assert platform.pids()["web2"] == second and [p for p, _, _ in platform.restarts] == ["web"]
        assert wait_for(lambda: served(platform.url), timeout=30)
    finally:
        platform.stop()
    assert served(platform.url) is None  # the shared socket is closed with the last of them


def test_a_malformed_web_process_count_is_refused_by_name(tmp_path):
    for bad in ("0", "two", "-1"):
        with pytest.raises(StartupError, match=f"TRAINYARD_WEB_PROCESSES={bad!r} (is not an integer|must be at least 1)"):
            Sleepers(data_dir=tmp_path, port=free_port(), env={"REDIS_URL": "", "TRAINYARD_WEB_PROCESSES": bad})
