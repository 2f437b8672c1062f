"""A chaos trial: `steps` steps of 0.3 s, the metric after each, a checkpoint on SIGTERM and at every
step, resumed from $RESUME_FROM. Its metric curve rises towards a level set by --lr (best at 0.01)."""
import json
import math
import os
import signal
import sys
import time

stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
lr, steps = float(sys.argv[1]), int(sys.argv[2])
level = 1.0 - abs(math.log10(lr) + 2) / 4
step = 0
if os.environ.get("RESUME_FROM"):
    with open(os.environ["RESUME_FROM"]) as saved:
        step = json.load(saved)["step"]
    print(f"resuming at step {step}", flush=True)


def checkpoint():
    folder = os.environ["CHECKPOINT_DIR"]
    os.makedirs(folder, exist_ok=True)
    temporary = os.path.join(folder, ".step.tmp")
    with open(temporary, "w") as out:
        json.dump({"step": step}, out)
    os.replace(temporary, os.path.join(folder, f"step-{step}.json"))


while step < steps:
    time.sleep(0.3)
    step += 1
    value = level * (1 - 0.5 ** step)
    print("TRAINYARD_METRIC " + json.dumps({"name": "score", "value": value, "step": step}), flush=True)
    checkpoint()
    if stop:
        print(f"stopping at step {step}", flush=True)
        sys.exit(0)
