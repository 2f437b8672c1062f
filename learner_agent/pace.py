"""How fast a learner's output is taken from it: a token bucket over the bytes of its log lines.

Every line a learner prints is shipped to the platform, whose ingest is shared by every tenant. A
learner printing as fast as it can (long lines in a loop) would otherwise take that ingest, and the
web process and database behind it, from everybody for as long as it prints. Past the bucket's
burst, the agent reads the learner's pipes no faster than the rate, so the pipe fills and the
learner's own writes wait: its output is slowed, never dropped (what Docker's blocking log mode
does). A learner printing less than the rate never waits.
"""
import threading
import time


class Pace:
    """`take(n)` returns once n more bytes fit in `rate` bytes a second after a `burst`."""

    def __init__(self, rate, burst, *, clock=time.monotonic, sleep=time.sleep):
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(burst)
        self._last = clock()
        self._lock = threading.Lock()  # stdout's and stderr's readers share one bucket

    def take(self, n):
        """Spend n bytes; sleep while the bucket is in debt. Returns the seconds slept."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate) - n
            self._last = now
            debt = -self._tokens
        if debt <= 0:
            return 0.0
        wait = debt / self.rate
        self._sleep(wait)
        return wait
