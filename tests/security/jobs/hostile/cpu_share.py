"""Burn CPU in 16 processes for two seconds of wall time; print how many CPUs' worth we really got.

Sixteen, not one: on a busy machine a single process may get less than its quota anyway, while
sixteen get far more than a quarter of a CPU unless a quota holds them."""
import os
import time

WORKERS, SECONDS = 16, 2.0
start = time.monotonic()
for _ in range(WORKERS):
    if os.fork() == 0:
        while time.monotonic() - start < SECONDS:
            pass
        os._exit(0)
for _ in range(WORKERS):
    os.wait()
wall = time.monotonic() - start
times = os.times()
print(f"CPUSHARE {(times.children_user + times.children_system) / wall:.2f}", flush=True)
