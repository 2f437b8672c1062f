"""A small CNN trained on scikit-learn's bundled 8x8 digits: Trainyard's reference PyTorch job.

It shows everything a learner can do on the platform (SPEC §6) while still running bare on a laptop:
hyper-parameters from argv, metrics both as a human log line (scraped by the manifest's regex) and as
TRAINYARD_METRIC lines, an atomic checkpoint per epoch, resume from $RESUME_FROM, a checkpoint at the
next batch boundary on SIGTERM (halt), and final results in $RESULT_DIR. The data ships with
scikit-learn, so nothing is downloaded.
"""
import argparse
import json
import os
import signal
import sys
import time


class StopRequest:
    """Set by SIGTERM; the training loop checks it at every batch boundary (no I/O in the handler)."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame):
        self.requested = True


STOP = StopRequest()
signal.signal(signal.SIGTERM, STOP)  # before the slow imports below, so an early halt is not lost

import torch  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from torch import nn  # noqa: E402

try:
    from learner_agent import report
except ImportError:  # running bare, without the platform on the path
    def report(name, value, step=None):
        point = {"name": name, "value": float(value)}
        if step is not None:
            point["step"] = step
        print("TRAINYARD_METRIC " + json.dumps(point), flush=True)


class DigitsNet(nn.Module):
    def __init__(self, width=48):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),                                    # 8x8 -> 4x4
            nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.ReLU(),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(0.25),
                                        nn.Linear(2 * width * 16, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--width", type=int, default=48, help="channels of the first convolution")
    return parser.parse_args(argv)


def load_data():
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.long)
    # The split is fixed (not tied to --seed) so runs with different seeds are comparable.
    train_idx, val_idx = train_test_split(range(len(labels)), test_size=0.2, random_state=0,
                                          stratify=digits.target)
    return images[train_idx], labels[train_idx], images[val_idx], labels[val_idx]


def batch_order(n, epoch, seed):
    """The shuffle of one epoch depends only on (seed, epoch), so a resumed run sees the same batches."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=generator)


def evaluate(model, images, labels):
    model.eval()
    with torch.no_grad():
        logits = model(images)
        loss = nn.functional.cross_entropy(logits, labels).item()
        accuracy = (logits.argmax(dim=1) == labels).float().mean().item()
    model.train()
    return loss, accuracy


def save_checkpoint(path, state):
    """Write under a hidden temporary name, then rename: a kill mid-write never leaves a truncated
    checkpoint, and the platform (which ignores dot-files) never offers a half-written one."""
    folder, name = os.path.split(path)
    os.makedirs(folder or ".", exist_ok=True)
    temporary = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    torch.save(state, temporary)
    os.replace(temporary, path)


class Run:
    """The model, optimizer and progress of one training run: what a checkpoint holds."""

    def __init__(self, args):
        self.args = args
        self.model = DigitsNet(args.width)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.next_epoch, self.batch, self.epoch_loss, self.epoch_seen = 1, 0, 0.0, 0
        self.history = []

    def save(self, path):
        save_checkpoint(path, {
            "next_epoch": self.next_epoch, "batch": self.batch, "epoch_loss": self.epoch_loss,
            "epoch_seen": self.epoch_seen, "history": self.history, "args": vars(self.args),
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state()})

    def load(self, path):
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        self.next_epoch, self.batch = state["next_epoch"], state["batch"]
        self.epoch_loss, self.epoch_seen = state["epoch_loss"], state["epoch_seen"]
        self.history = state["history"]

    def train_epoch(self, train_x, train_y, stop):
        """Train self.next_epoch from self.batch on; return False when stopped at a batch boundary."""
        batches = batch_order(len(train_y), self.next_epoch, self.args.seed).split(self.args.batch_size)
        self.model.train()
        for index in range(self.batch, len(batches)):
            batch = batches[index]
            self.optimizer.zero_grad()
            loss = nn.functional.cross_entropy(self.model(train_x[batch]), train_y[batch])
            loss.backward()
            self.optimizer.step()
            self.batch = index + 1
            self.epoch_loss += loss.item() * len(batch)
            self.epoch_seen += len(batch)
            if stop.requested and self.batch < len(batches):
                return False
        return True

    def finish_epoch(self, val_x, val_y):
        """Evaluate, record and reset the per-epoch counters; return the history entry."""
        val_loss, val_acc = evaluate(self.model, val_x, val_y)
        entry = {"epoch": self.next_epoch, "loss": self.epoch_loss / max(self.epoch_seen, 1),
                 "val_loss": val_loss, "val_acc": val_acc}
        self.history.append(entry)
        self.next_epoch, self.batch, self.epoch_loss, self.epoch_seen = self.next_epoch + 1, 0, 0.0, 0
        return entry


def write_results(run, result_dir):
    os.makedirs(result_dir, exist_ok=True)
    save_checkpoint(os.path.join(result_dir, "model.pt"), run.model.state_dict())
    final = run.history[-1] if run.history else {}
    with open(os.path.join(result_dir, "metrics.json"), "w") as out:
        json.dump({"final": final, "history": run.history, "args": vars(run.args)}, out, indent=2)
    return final


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    checkpoint_dir = os.environ.get("CHECKPOINT_DIR") or "./checkpoints"
    result_dir = os.environ.get("RESULT_DIR") or "./results"
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    train_x, train_y, val_x, val_y = load_data()
    run = Run(args)
    if os.environ.get("RESUME_FROM"):
        run.load(os.environ["RESUME_FROM"])
        where = f" after batch {run.batch}" if run.batch else ""
        print(f"resuming from {os.environ['RESUME_FROM']} at epoch {run.next_epoch}{where}", flush=True)
    print(f"training on {len(train_y)} digits, validating on {len(val_y)}; "
          f"epochs {args.epochs} lr {args.lr} batch {args.batch_size} seed {args.seed}", flush=True)

    while run.next_epoch <= args.epochs:
        epoch, started = run.next_epoch, time.monotonic()
        if not run.train_epoch(train_x, train_y, STOP):
            path = os.path.join(checkpoint_dir, f"epoch-{epoch}-partial.pt")
            run.save(path)
            print(f"stop requested: wrote {path} (epoch {epoch}, batch {run.batch}); exiting", flush=True)
            return 0
        entry = run.finish_epoch(val_x, val_y)
        seconds = time.monotonic() - started
        print(f"epoch {epoch}/{args.epochs} loss {entry['loss']:.4f} val_acc {entry['val_acc']:.4f} "
              f"({seconds:.1f}s)", flush=True)
        report("val_loss", entry["val_loss"], step=epoch)
        report("epoch_seconds", round(seconds, 3), step=epoch)
        run.save(os.path.join(checkpoint_dir, f"epoch-{epoch}.pt"))
        if STOP.requested and run.next_epoch <= args.epochs:
            print(f"stop requested: wrote the checkpoint of epoch {epoch}; exiting", flush=True)
            return 0

    final = write_results(run, result_dir)
    print(f"done: val_acc {final.get('val_acc', 0):.4f}; results in {result_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
