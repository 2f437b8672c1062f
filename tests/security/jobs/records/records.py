"""What tests/security/test_records.py runs: `metrics` reports a step no int64 holds between two good
points; `artifacts` writes results with hostile names; `wait` waits for the test's go-ahead (a file
in its results) and then prints as many filler lines as the test posted records in its name."""
import os
import sys
import time

RESULTS = os.environ["RESULT_DIR"]


def metrics():
    print('TRAINYARD_METRIC {"name": "loss", "value": 0.5, "step": 1}', flush=True)
    print('TRAINYARD_METRIC {"name": "loss", "value": 0.4, "step": 1e300}', flush=True)
    print('TRAINYARD_METRIC {"name": "loss", "value": 0.3, "step": 2}', flush=True)
    print("records: done", flush=True)


def artifacts():
    for name in ("good.txt", "bad\nname.txt", "odd #1?.txt"):
        with open(os.path.join(RESULTS, name), "w") as f:
            f.write(f"content of {name!r}\n")
    print("records: wrote results", flush=True)


def wait():
    print("records: waiting", flush=True)
    go = os.path.join(RESULTS, "go")
    deadline = time.monotonic() + 120
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.2)
    with open(go) as f:
        posted = int(f.read())
    os.unlink(go)
    # The test's records took the seqs this agent numbers next: these lines are taken for resends.
    for i in range(posted):
        print(f"records: filler {i}", flush=True)
    print("records: done", flush=True)


{"metrics": metrics, "artifacts": artifacts, "wait": wait}[sys.argv[1]]()
