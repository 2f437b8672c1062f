"""A Redis server of a test's own: the embedded binary `make demo` runs (portal.runner), no
persistence, on a free port; it can be stopped and started again on the same port."""
import subprocess
import time

import redis

from portal import runner


class RedisServer:
    def __init__(self, directory):
        self.port, self.directory, self.process = runner.free_port(), directory, None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self):
        self.process = subprocess.Popen([str(runner.embedded_redis_binary()), "--port", str(self.port), "--bind",
                                         "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.directory)],
                                        stdout=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self):
        self.process.kill()
        self.process.wait()
