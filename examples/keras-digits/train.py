"""Keras 3 on TensorFlow: a small dense network on scikit-learn's bundled 8x8 digits (offline).

Prints `epoch 2/5 loss 0.31 val_acc 0.93` (scraped by the manifest's regex) and TRAINYARD_METRIC
lines, saves `$CHECKPOINT_DIR/epoch-<n>.keras` after every epoch (atomically), resumes from
`$RESUME_FROM`, stops after the current epoch on SIGTERM (halt), and writes model.keras and
metrics.json into `$RESULT_DIR`.
"""
import argparse
import json
import os
import re
import signal
import sys

STOP = []
signal.signal(signal.SIGTERM, lambda *_: STOP.append(True))
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


class Report(keras.callbacks.Callback):
    """Log line, metrics and an atomic checkpoint at the end of every epoch; stop when asked."""

    def __init__(self, epochs, checkpoint_dir):
        super().__init__()
        self.epochs, self.checkpoint_dir = epochs, checkpoint_dir
        self.history = []

    def on_epoch_end(self, epoch, logs=None):
        number = epoch + 1
        logs = logs or {}
        entry = {"epoch": number, "loss": float(logs["loss"]), "val_acc": float(logs["val_accuracy"])}
        self.history.append(entry)
        print(f"epoch {number}/{self.epochs} loss {entry['loss']:.4f} val_acc {entry['val_acc']:.4f}", flush=True)
        print("TRAINYARD_METRIC " + json.dumps({"name": "val_loss", "value": float(logs["val_loss"]),
                                                "step": number}), flush=True)
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        path = os.path.join(self.checkpoint_dir, f"epoch-{number}.keras")
        temporary = os.path.join(self.checkpoint_dir, f".tmp-{os.getpid()}-epoch-{number}.keras")
        self.model.save(temporary)
        os.replace(temporary, path)
        if STOP:
            print(f"stop requested: checkpoint {path} written; exiting", flush=True)
            self.model.stop_training = True


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    keras.utils.set_random_seed(args.seed)
    checkpoint_dir = os.environ.get("CHECKPOINT_DIR") or "./checkpoints"
    result_dir = os.environ.get("RESULT_DIR") or "./results"
    digits = load_digits()
    x = (digits.images / 16.0).reshape(-1, 64).astype("float32")
    train_x, val_x, train_y, val_y = train_test_split(x, digits.target, test_size=0.2, random_state=0,
                                                      stratify=digits.target)
    initial_epoch = 0
    if os.environ.get("RESUME_FROM"):
        model = keras.models.load_model(os.environ["RESUME_FROM"])
        initial_epoch = int(re.search(r"epoch-(\d+)", os.path.basename(os.environ["RESUME_FROM"])).group(1))
        print(f"resuming from {os.environ['RESUME_FROM']} after epoch {initial_epoch}", flush=True)
    else:
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                                  keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    print(f"keras {keras.__version__} on {keras.backend.backend()}: {len(train_y)} training digits, "
          f"epochs {args.epochs}", flush=True)
    report = Report(args.epochs, checkpoint_dir)
    model.fit(train_x, train_y, validation_data=(val_x, val_y), epochs=args.epochs, initial_epoch=initial_epoch,
              batch_size=args.batch_size, verbose=0, callbacks=[report])
    if STOP:
        return 0
    os.makedirs(result_dir, exist_ok=True)
    model.save(os.path.join(result_dir, "model.keras"))
    with open(os.path.join(result_dir, "metrics.json"), "w") as out:
        json.dump({"history": report.history}, out, indent=2)
    final = report.history[-1] if report.history else {}
    print(f"done: val_acc {final.get('val_acc', 0):.4f}; results in {result_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
