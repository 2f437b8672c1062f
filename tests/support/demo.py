"""`python manage.py demo` (what `make demo` runs) as a user runs it, for the end-to-end tests."""
import json
import signal
import subprocess
import sys
import time

from portal.runner import PROJECT_ROOT


class Demo:
    """`python manage.py demo` as a user runs it, in the foreground until interrupted."""

    def __init__(self, data_dir, env):
        self.data_dir, self.env = data_dir, env
        self.process = None

    def start(self, port, timeout=120):
        log = open(self.data_dir / f"demo-{port}.out", "wb")
        env = dict(self.env, TRAINYARD_PORT=str(port))
        self.process = subprocess.Popen([sys.executable, "manage.py", "demo"], cwd=PROJECT_ROOT, env=env,
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        output = self.data_dir / f"demo-{port}.out"
        while b"Trainyard is running." not in output.read_bytes():
            assert self.process.poll() is None, f"the demo exited: {output.read_text(errors='replace')}"
            assert time.monotonic() < deadline, f"the demo did not start: {output.read_text(errors='replace')}"
            time.sleep(0.2)
        facts = json.loads((self.data_dir / "demo.json").read_text())
        return facts["url"], facts["token"]

    def interrupt(self, timeout=60):
        """Ctrl-C: SIGINT to the demo, which stops everything it started."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
