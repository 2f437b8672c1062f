"""TensorFlow with TensorBoard summaries: a small dense network on scikit-learn's bundled 8x8 digits (offline).

Writes `tf.summary.scalar`s the way any TensorFlow program does, into `$LOG_DIR/tb/train` (loss every
10 batches, step = batch number) and `$LOG_DIR/tb/validation` (loss and accuracy per epoch, step =
epoch). Nothing Trainyard-specific is printed or imported: the manifest's
`evaluation_metrics: {type: tensorboard}` has the platform read the event files while it runs. Writers
flush every second and at the end of each epoch, so the charts move as it trains. Stops after the
current epoch on SIGTERM (halt) and writes metrics.json into `$RESULT_DIR`.
"""
import argparse
import json
import os
import signal
import sys
import time

STOP = []
signal.signal(signal.SIGTERM, lambda *_: STOP.append(True))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--epoch-pause", type=float, default=0.0,
                        help="seconds to wait after each epoch (to watch the charts grow)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    tf.keras.utils.set_random_seed(args.seed)
    log_dir = os.path.join(os.environ.get("LOG_DIR") or "./logs", "tb")
    result_dir = os.environ.get("RESULT_DIR") or "./results"
    digits = load_digits()
    x = (digits.images / 16.0).reshape(-1, 64).astype("float32")
    train_x, val_x, train_y, val_y = train_test_split(x, digits.target, test_size=0.2, random_state=0,
                                                      stratify=digits.target)
    model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    optimizer = tf.keras.optimizers.Adam(args.lr)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    train_writer = tf.summary.create_file_writer(os.path.join(log_dir, "train"), flush_millis=1000)
    val_writer = tf.summary.create_file_writer(os.path.join(log_dir, "validation"), flush_millis=1000)

    @tf.function
    def train_step(features, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(features, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    print(f"tensorflow {tf.__version__}: {len(train_y)} training digits, epochs {args.epochs}, "
          f"summaries in {log_dir}", flush=True)
    batches = tf.data.Dataset.from_tensor_slices((train_x, train_y))
    step, history = 0, []
    for epoch in range(1, args.epochs + 1):
        for features, labels in batches.shuffle(len(train_y), seed=args.seed + epoch).batch(args.batch_size):
            loss = train_step(features, labels)
            step += 1
            if step % 10 == 0:
                with train_writer.as_default():
                    tf.summary.scalar("loss", loss, step=step)
        logits = model(val_x, training=False)
        val_loss = float(loss_fn(val_y, logits))
        val_acc = float(np.mean(np.argmax(logits, axis=1) == val_y))
        with val_writer.as_default():
            tf.summary.scalar("loss", val_loss, step=epoch)
            tf.summary.scalar("accuracy", val_acc, step=epoch)
        train_writer.flush()
        val_writer.flush()
        history.append({"epoch": epoch, "val_loss": val_loss, "val_acc": val_acc})
        print(f"epoch {epoch}/{args.epochs} val_loss {val_loss:.4f} val_acc {val_acc:.4f}", flush=True)
        if STOP:
            print("stop requested: exiting after this epoch", flush=True)
            break
        time.sleep(args.epoch_pause)
    train_writer.close()
    val_writer.close()
    os.makedirs(result_dir, exist_ok=True)
    with open(os.path.join(result_dir, "metrics.json"), "w") as f:
        json.dump(history, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
