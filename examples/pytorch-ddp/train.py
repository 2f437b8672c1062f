"""Data-parallel PyTorch (DistributedDataParallel, gloo on CPU) on scikit-learn's bundled 8x8 digits.

One script for one learner or many: with WORLD_SIZE > 1 (set by Trainyard for `learners: N`, as
torchrun would) it joins the process group through env:// (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), splits every global batch between the learners and lets DDP average the gradients.
The loss it prints is averaged over all learners (all_reduce), so every learner's log shows the
same number. A halt (SIGTERM to every learner) is agreed on collectively at the next batch: all
learners stop at the same step, learner 0 writes the checkpoint, and a resumed job continues from it
with any number of learners. Runs bare too: `python train.py` is a one-learner job.
"""
import argparse
import json
import os
import signal
import sys
import time


class StopRequest:
    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame):
        self.requested = True


STOP = StopRequest()
signal.signal(signal.SIGTERM, STOP)  # before the slow imports, so an early halt is not lost
# The learners agree on stopping every few steps: one more collective per step would cost throughput.
STOP_CHECK_EVERY = 8

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402


def report(name, value, step):
    print("TRAINYARD_METRIC " + json.dumps({"name": name, "value": float(value), "step": step}), flush=True)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--global-batch", type=int, default=128, help="split evenly between the learners")
    parser.add_argument("--width", type=int, default=512, help="hidden units (more = more compute per sample)")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def make_model(width):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def load_data():
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    train_idx, val_idx = train_test_split(range(len(y)), test_size=0.2, random_state=0, stratify=digits.target)
    return x[train_idx], y[train_idx], x[val_idx], y[val_idx]


def all_sum(*values):
    """Sum each value over all learners (identity for one learner)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def save_checkpoint(path, state):
    folder, name = os.path.split(path)
    os.makedirs(folder or ".", exist_ok=True)
    temporary = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    torch.save(state, temporary)
    os.replace(temporary, path)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    checkpoint_dir = os.environ.get("CHECKPOINT_DIR") or "./checkpoints"
    result_dir = os.environ.get("RESULT_DIR") or "./results"
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    torch.manual_seed(args.seed)  # the same initial weights on every learner
    train_x, train_y, val_x, val_y = load_data()
    model = make_model(args.width)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    next_epoch, step, history = 1, 0, []
    if os.environ.get("RESUME_FROM"):
        state = torch.load(os.environ["RESUME_FROM"], map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        next_epoch, step, history = state["next_epoch"], state["step"], state["history"]
        print(f"learner {rank}: resuming from {os.environ['RESUME_FROM']} at epoch {next_epoch} "
              f"step {step}", flush=True)
    trained = DistributedDataParallel(model) if world > 1 else model
    per_learner = args.global_batch // world
    print(f"learner {rank} of {world}: {len(train_y)} training digits, global batch {per_learner * world} "
          f"({per_learner} here), epochs {args.epochs}", flush=True)

    started, samples = time.monotonic(), 0
    while next_epoch <= args.epochs:
        order = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(args.seed * 1000 + next_epoch))
        batches = order.split(per_learner * world)
        first_batch = step % len(batches) if step else 0
        loss_sum, seen = 0.0, 0
        for index in range(first_batch, len(batches)):
            mine = batches[index][rank::world]
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(trained(train_x[mine]), train_y[mine])
            loss.backward()  # DDP averages the gradients over the learners here
            optimizer.step()
            step += 1
            loss_sum += loss.item() * len(mine)
            seen += len(mine)
            samples += len(mine)
            if step % STOP_CHECK_EVERY:
                continue
            stop, = all_sum(1.0 if STOP.requested else 0.0)  # every learner stops at the same step
            if stop and index + 1 < len(batches):
                if rank == 0:
                    save_checkpoint(os.path.join(checkpoint_dir, f"step-{step}-partial.pt"), {
                        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "next_epoch": next_epoch, "step": step, "history": history})
                print(f"learner {rank}: stop requested; checkpoint at epoch {next_epoch} step {step}; exiting",
                      flush=True)
                return finish()
        total_loss, total_seen = all_sum(loss_sum, seen)
        model.eval()
        with torch.no_grad():
            val_acc = (model(val_x).argmax(dim=1) == val_y).float().mean().item()
        model.train()
        entry = {"epoch": next_epoch, "loss": total_loss / max(total_seen, 1), "val_acc": val_acc}
        history.append(entry)
        print(f"epoch {next_epoch}/{args.epochs} loss {entry['loss']:.4f} val_acc {val_acc:.4f} "
              f"(learner {rank} of {world})", flush=True)
        report("loss", entry["loss"], next_epoch)
        next_epoch, step = next_epoch + 1, 0
        if rank == 0:
            save_checkpoint(os.path.join(checkpoint_dir, f"epoch-{entry['epoch']}.pt"), {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(), "next_epoch": next_epoch,
                "step": 0, "history": history})
        if dist.is_initialized():
            dist.barrier()
        stop, = all_sum(1.0 if STOP.requested else 0.0)
        if stop and next_epoch <= args.epochs:
            print(f"learner {rank}: stop requested; checkpoint of epoch {entry['epoch']} written; exiting", flush=True)
            return finish()

    elapsed = time.monotonic() - started
    total_samples, = all_sum(samples)
    throughput = total_samples / elapsed if elapsed > 0 else 0.0
    print(f"learner {rank}: done; {total_samples:.0f} samples in {elapsed:.2f}s = {throughput:.1f} samples/s "
          f"(all learners)", flush=True)
    report("throughput_samples_per_s", throughput, args.epochs)
    if rank == 0:
        os.makedirs(result_dir, exist_ok=True)
        save_checkpoint(os.path.join(result_dir, "model.pt"), model.state_dict())
        with open(os.path.join(result_dir, "metrics.json"), "w") as out:
            json.dump({"history": history, "learners": world, "throughput_samples_per_s": throughput}, out, indent=2)
    return finish()


def finish():
    if dist.is_initialized():
        # Every learner gets here (they stop at the same step). Without the barrier the first to tear
        # down its connections can abort a peer still inside gloo (SIGABRT, exit 134).
        dist.barrier()
        dist.destroy_process_group()
        # The group outlives destroy_process_group while DDP has used it, and so do gloo's worker
        # threads; one that drops a tensor while Python shuts down aborts the learner (SIGABRT, exit
        # 134). Every file is written and closed by now, so the learner leaves without that shutdown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
