"""JAX: a two-layer network fitted to generated data (y = sin(3x) + noise) with plain gradient descent.

Nothing is downloaded: the data comes from a fixed seed. Prints `step 100/500 loss 0.0421` (scraped by
the manifest's regex) plus a TRAINYARD_METRIC line per report, saves `$CHECKPOINT_DIR/step-<n>.npz`
(atomically) every `--checkpoint-every` steps, resumes from `$RESUME_FROM`, stops at the next report
on SIGTERM (halt), and writes params.npz and metrics.json into `$RESULT_DIR`.
"""
import argparse
import json
import os
import signal
import sys

STOP = []
signal.signal(signal.SIGTERM, lambda *_: STOP.append(True))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--report-every", type=int, default=50)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_data(seed, n=512):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, size=(n, 1)).astype("float32")
    y = (np.sin(3 * x) + 0.05 * rng.normal(size=(n, 1))).astype("float32")
    return jnp.asarray(x), jnp.asarray(y)


def init_params(seed, hidden):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"w1": jax.random.normal(k1, (1, hidden)) * 1.0, "b1": jnp.zeros(hidden),
            "w2": jax.random.normal(k2, (hidden, 1)) / jnp.sqrt(hidden), "b2": jnp.zeros(1)}


def predict(params, x):
    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def loss_fn(params, x, y):
    return jnp.mean((predict(params, x) - y) ** 2)


def save(path, params, step):
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    temporary = os.path.join(folder, f".tmp-{os.getpid()}.npz")
    np.savez(temporary, step=step, **{k: np.asarray(v) for k, v in params.items()})
    os.replace(temporary, path)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    checkpoint_dir = os.environ.get("CHECKPOINT_DIR") or "./checkpoints"
    result_dir = os.environ.get("RESULT_DIR") or "./results"
    x, y = make_data(args.seed)
    params, step = init_params(args.seed, args.hidden), 0
    if os.environ.get("RESUME_FROM"):
        saved = np.load(os.environ["RESUME_FROM"])
        params = {k: jnp.asarray(saved[k]) for k in ("w1", "b1", "w2", "b2")}
        step = int(saved["step"])
        print(f"resuming from {os.environ['RESUME_FROM']} at step {step}", flush=True)
    print(f"jax {jax.__version__} on {jax.default_backend()}: {x.shape[0]} points, steps {args.steps}", flush=True)

    @jax.jit
    def update(params):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - args.lr * g, params, grads), loss

    history = []
    while step < args.steps:
        params, loss = update(params)
        step += 1
        if step % args.report_every == 0 or step == args.steps:
            value = float(loss)
            history.append({"step": step, "loss": value})
            print(f"step {step}/{args.steps} loss {value:.5f}", flush=True)
            print("TRAINYARD_METRIC " + json.dumps({"name": "mse", "value": value, "step": step}), flush=True)
        if step % args.checkpoint_every == 0 or (STOP and step % args.report_every == 0):
            save(os.path.join(checkpoint_dir, f"step-{step}.npz"), params, step)
            if STOP:
                print(f"stop requested: checkpoint at step {step}; exiting", flush=True)
                return 0
    os.makedirs(result_dir, exist_ok=True)
    save(os.path.join(result_dir, "params.npz"), params, step)
    with open(os.path.join(result_dir, "metrics.json"), "w") as out:
        json.dump({"history": history}, out, indent=2)
    print(f"done: mse {history[-1]['loss']:.5f}; results in {result_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
