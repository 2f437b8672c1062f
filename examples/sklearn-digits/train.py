"""scikit-learn: an SGD linear classifier trained epoch by epoch with partial_fit on 8x8 digits.

The data is `$DATA_DIR/digits.npz` (arrays `x` and `y`) when the job brought one from a data store,
else scikit-learn's bundled digits (offline). Prints `epoch 3/10 loss 0.41 val_acc 0.93` (scraped by
the manifest's regex), pickles the model into `$CHECKPOINT_DIR/epoch-<n>.pkl` after every epoch
(atomically), resumes from `$RESUME_FROM`, stops after the current epoch on SIGTERM, and writes
model.pkl and metrics.json into `$RESULT_DIR`.
"""
import argparse
import json
import os
import pickle
import signal
import sys

STOP = []
signal.signal(signal.SIGTERM, lambda *_: STOP.append(True))

import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.linear_model import SGDClassifier  # noqa: E402
from sklearn.metrics import log_loss  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def load_data():
    """The job's own data when a data store brought it into DATA_DIR, else the bundled digits."""
    path = os.path.join(os.environ.get("DATA_DIR") or "./data", "digits.npz")
    if os.path.exists(path):
        data = np.load(path)
        print(f"data: {path} ({len(data['y'])} samples)", flush=True)
        return data["x"].astype("float64"), data["y"]
    digits = load_digits()
    print(f"data: scikit-learn's bundled digits ({len(digits.target)} samples)", flush=True)
    return digits.images.reshape(-1, 64) / 16.0, digits.target


def save(path, state):
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    temporary = os.path.join(folder, f".tmp-{os.getpid()}-{os.path.basename(path)}")
    with open(temporary, "wb") as out:
        pickle.dump(state, out)
    os.replace(temporary, path)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    checkpoint_dir = os.environ.get("CHECKPOINT_DIR") or "./checkpoints"
    result_dir = os.environ.get("RESULT_DIR") or "./results"
    x, y = load_data()
    train_x, val_x, train_y, val_y = train_test_split(x, y, test_size=0.2, random_state=0)
    classes = np.unique(y)
    model, epoch, history = SGDClassifier(loss="log_loss", alpha=1e-4, random_state=args.seed), 0, []
    if os.environ.get("RESUME_FROM"):
        with open(os.environ["RESUME_FROM"], "rb") as saved:
            state = pickle.load(saved)
        model, epoch, history = state["model"], state["epoch"], state["history"]
        print(f"resuming from {os.environ['RESUME_FROM']} after epoch {epoch}", flush=True)
    while epoch < args.epochs:
        epoch += 1
        # Each epoch's order depends only on (seed, epoch), so a resumed run sees the same batches.
        order = np.random.default_rng(args.seed * 1000 + epoch).permutation(len(train_y))
        model.partial_fit(train_x[order], train_y[order], classes=classes)
        loss = log_loss(train_y, model.predict_proba(train_x), labels=classes)
        val_acc = float(model.score(val_x, val_y))
        history.append({"epoch": epoch, "loss": loss, "val_acc": val_acc})
        print(f"epoch {epoch}/{args.epochs} loss {loss:.4f} val_acc {val_acc:.4f}", flush=True)
        save(os.path.join(checkpoint_dir, f"epoch-{epoch}.pkl"), {"model": model, "epoch": epoch, "history": history})
        if STOP and epoch < args.epochs:
            print(f"stop requested: checkpoint of epoch {epoch} written; exiting", flush=True)
            return 0
    os.makedirs(result_dir, exist_ok=True)
    save(os.path.join(result_dir, "model.pkl"), {"model": model, "epoch": epoch, "history": history})
    with open(os.path.join(result_dir, "metrics.json"), "w") as out:
        json.dump({"history": history}, out, indent=2)
    print(f"done: val_acc {history[-1]['val_acc']:.4f}; results in {result_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
