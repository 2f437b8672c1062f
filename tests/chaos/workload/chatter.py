"""The chaos suite's learner: a known amount of output, so the platform's copy can be counted exactly.

`python3 chatter.py LINES EVERY SECONDS` prints LINES numbered lines over about SECONDS seconds and,
after every EVERY lines, one TRAINYARD_METRIC line; then exits 0. Every line names the attempt, so
lines of a restarted attempt never look like the first attempt's.
"""
import json
import os
import sys
import time

PAUSE_EVERY = 50  # lines between pauses: steady output without a syscall-heavy sleep per line


def main(lines, every, seconds):
    attempt = int(os.environ.get("TRAINYARD_ATTEMPT", "1"))
    pause = seconds * PAUSE_EVERY / lines
    for i in range(1, lines + 1):
        print(f"a{attempt} line {i:05d} of {lines}")
        if i % every == 0:
            step = i // every
            print("TRAINYARD_METRIC " + json.dumps({"name": "loss", "value": attempt * 10000 + step, "step": step,
                                                    "attempt": attempt}))
        if i % PAUSE_EVERY == 0:
            time.sleep(pause)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
