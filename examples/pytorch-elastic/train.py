"""Elastic data-parallel PyTorch (DistributedDataParallel, gloo on CPU) on scikit-learn's bundled digits.

Trainyard may stop this job at any step and restart it with another number of learners and another
batch size (a resize is a coordinated checkpoint and restart), or change its batch size while it runs
(learner_agent.batch_changes: no restart). So progress is counted in samples,
not steps or epochs: every epoch visits the training set in a fixed permutation (seeded by the
epoch), each step takes the next `global_batch` positions of it and splits them between the
learners (`local_batch` each), and the checkpoint records how many samples the job has done. A
resumed attempt, at any world size and batch, continues at exactly the sample where the last one
stopped: across all attempts every sample is trained on exactly once per epoch.

- Batch sizes, the learning-rate factor, world size, rank and the checkpoint to resume from come
  from `learner_agent.batch_config()`. The learning rate is `--lr` (the rate for the manifest's
  `batch_size.global`) x the factor x a cosine decay over the job's samples. When an attempt starts
  with another factor than the checkpoint was trained with, the factor moves there linearly over
  `--warmup-steps` steps (a fresh start warms up from 1).
- A batch change the platform asks for while the learners run: learner 0 looks for one before each
  step's collective (`BatchChanges.poll`) and adds it to the collective, so every learner switches
  after the same step; the learning-rate factor moves to the new batch's over `--warmup-steps`, and
  learner 0 reports the change applied.
- SIGTERM (the checkpoint signal) only sets a flag. Every step the learners all-reduce it together
  with the step's loss, so all of them stop after the same step; learner 0 writes one checkpoint
  (atomically: a temporary file, then a rename) and all exit 0.
- Every learner logs the sample indices it trained on, one line per step:
  `samples epoch=2 step=57 rank=1 idx=3,17..18,40` (ascending, runs of consecutive indices as a..b).
- Learner 0 reports `samples` (cumulative over the job), `loss` and `val_acc` with `report()`, and
  the gradient noise scale (`noise_scale`, learner_agent.goodput): each learner computes the gradient
  of the first half of its part of the step without the all-reduce (DDP's `no_sync`), then the second
  half with it; the squared norms of the half's mean gradient (averaged over the learners) and of the
  whole step's are the two batch sizes the estimator needs. The step's gradient is the same as one
  pass over the whole part would give. `--no-noise-scale` skips it (the platform then never gives the
  job a larger global batch than its own).

Runs bare too: `python train.py` is a one-learner job writing to ./checkpoints and ./results.
"""
import argparse
import gzip
import importlib.util
import json
import math
import os
import contextlib
import signal
import sys
import time


class StopRequest:
    """The checkpoint signal's handler: only remembers that it came (the training loop acts on it)."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame):
        self.requested = True


STOP = StopRequest()
signal.signal(signal.SIGTERM, STOP)  # before the slow imports, so an early signal is not lost

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

try:
    from learner_agent import batch_config, report
    from learner_agent.batch_changes import NO_CHANGE, BatchChange, BatchChanges
    from learner_agent.goodput import GradientNoiseScale, squared_grad_norm
except ImportError:  # a bare run from a checkout: the helper lives at the repository's top
    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))
    from learner_agent import batch_config, report
    from learner_agent.batch_changes import NO_CHANGE, BatchChange, BatchChanges
    from learner_agent.goodput import GradientNoiseScale, squared_grad_norm


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1,
                        help="learning rate for the manifest's batch_size.global (scaled by TRAINYARD_LR_SCALE)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="global batch when the platform sets none (a bare run)")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024, help="hidden units of the MLP")
    parser.add_argument("--report-every", type=int, default=10, help="steps between `samples`/`loss` reports")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-delay", type=float, default=0.0,
                        help="seconds to pause after each step: a demo or test at a known pace on any machine")
    parser.add_argument("--sample-delay", type=float, default=0.0,
                        help="seconds of each step per sample of this learner's part: on virtual GPUs (the "
                             "local backend's TRAINYARD_LOCAL_GPUS) a stand-in for a GPU's compute, so that more "
                             "learners take a step faster, as on real GPUs")
    parser.add_argument("--no-noise-scale", action="store_true",
                        help="do not measure or report the gradient noise scale")
    parser.add_argument("--noise-scale-schedule", type=noise_schedule, default=None, metavar="STEP:VALUE,...",
                        help="report this scripted noise scale (VALUE from each STEP on) in place of the measured "
                             "one: the platform's batch decisions on a schedule known in advance (demos, tests)")
    return parser.parse_args(argv)


def noise_schedule(text):
    """`0:8,60:4000` -> [(0, 8.0), (60, 4000.0)], by step."""
    try:
        pairs = sorted((int(step), float(value)) for step, value in (part.split(":") for part in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STEP:VALUE,..., got {text!r}") from None
    if pairs[0][0] != 0 or any(not value > 0 for _, value in pairs):
        raise argparse.ArgumentTypeError(f"the first STEP must be 0 and every VALUE > 0, got {text!r}")
    return pairs


def scheduled(schedule, step):
    """The schedule's value at `step`: that of its last entry at or before it."""
    return [value for start, value in schedule if start <= step][-1]


def make_model(width):
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def load_data():
    """The digits bundled with scikit-learn (1,797 8x8 images), read from the package's own file
    without importing scikit-learn: every resize restarts the learners, and on a busy machine the
    import costs seconds each time. A fixed stratified 80/20 split (seeded, the same everywhere)."""
    package = importlib.util.find_spec("sklearn").submodule_search_locations[0]
    with gzip.open(os.path.join(package, "datasets", "data", "digits.csv.gz"), "rt") as rows:
        table = torch.tensor([[float(v) for v in line.split(",")] for line in rows if line.strip()])
    x, y = table[:, :64] / 16.0, table[:, 64].long()
    generator = torch.Generator().manual_seed(0)
    val_idx = []
    for digit in range(10):
        members = (y == digit).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        val_idx += members[:round(0.2 * len(members))].tolist()
    is_val = torch.zeros(len(y), dtype=torch.bool)
    is_val[val_idx] = True
    return x[~is_val], y[~is_val], x[is_val], y[is_val]


def epoch_order(epoch, size, seed):
    """The order of epoch `epoch` (0-based): the same on every learner and in every attempt."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def warmed_up_scale(attempt_step, start_scale, target_scale, warmup_steps):
    """The learning-rate factor: linear from the checkpoint's to this attempt's over warmup_steps."""
    if attempt_step >= warmup_steps:
        return target_scale
    return start_scale + (target_scale - start_scale) * (attempt_step + 1) / warmup_steps


def decay(progress):
    """Cosine from 1 to 0 over the job's samples: the same schedule at any batch size or world size."""
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def index_ranges(indices):
    """`[40, 3, 18, 17]` -> `"3,17..18,40"`: a step's sample indices, compact and exactly countable."""
    runs = []
    for index in sorted(indices):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ",".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def all_sum(*values):
    """Sum each value over all learners (identity for one learner)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def save_checkpoint(path, state):
    """Write to a temporary name the platform never offers for resuming, then rename into place."""
    folder, name = os.path.split(path)
    os.makedirs(folder or ".", exist_ok=True)
    temporary = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    torch.save(state, temporary)
    os.replace(temporary, path)


def validation_accuracy(model, val_x, val_y):
    model.eval()
    with torch.no_grad():
        accuracy = (model(val_x).argmax(dim=1) == val_y).float().mean().item()
    model.train()
    return accuracy


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    config = batch_config(default_global_batch=args.batch_size)
    world, rank = config.world_size, config.rank
    if world > 1:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    checkpoint_dir = os.environ.get("CHECKPOINT_DIR") or "./checkpoints"
    result_dir = os.environ.get("RESULT_DIR") or "./results"
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    torch.manual_seed(args.seed)  # the same initial weights on every learner
    train_x, train_y, val_x, val_y = load_data()
    size = len(train_y)
    model = make_model(args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Progress: `samples` trained on by the whole job so far; the epoch and the position in its
    # order follow from it, whatever batch sizes got it there.
    state = {"samples": 0, "step": 0, "lr_scale": 1.0, "history": [], "epoch_loss": 0.0}
    noise = GradientNoiseScale()
    if config.resume_from:
        saved = torch.load(config.resume_from, map_location="cpu", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state = {key: saved[key] for key in state}
        if "noise_scale" in saved:
            noise.load_state_dict(saved["noise_scale"])
        print(f"learner {rank}: resuming from {config.resume_from} at samples={state['samples']} "
              f"(epoch {saved['epoch']}, step {saved['step']}, trained at global batch {saved['global_batch']}, "
              f"lr factor {saved['lr_scale']:g})", flush=True)
    trained = DistributedDataParallel(model) if world > 1 else model
    start_scale = state["lr_scale"]
    global_batch, target_scale, warm_from = config.global_batch, config.lr_scale, 0
    changes = BatchChanges(rank=rank)
    total = args.epochs * size
    print(f"learner {rank} of {world}: {size} training digits, global batch {config.global_batch} "
          f"({config.local_batch} here), lr {args.lr:g} x factor {start_scale:g} -> {config.lr_scale:g}, "
          f"{args.epochs} epochs = {total} samples", flush=True)

    saved_at = [None]

    def checkpoint():
        """Learner 0 saves the state after the last completed step (once per point of progress)."""
        if rank == 0 and saved_at[0] != state["samples"]:
            saved_at[0] = state["samples"]
            save_checkpoint(os.path.join(checkpoint_dir, f"samples-{state['samples']}.pt"), {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(), **state,
                "noise_scale": noise.state_dict(),
                "epoch": state["samples"] // size, "global_batch": global_batch, "world_size": world})

    if rank == 0:
        report(samples=state["samples"], step=state["step"])  # where this attempt starts
    stop, = all_sum(float(STOP.requested))  # a signal during start-up: stop before the first step
    attempt_step, since_report, loss_since_report = 0, 0, 0.0
    started = time.monotonic()
    while not stop and state["samples"] < total:
        epoch, offset = divmod(state["samples"], size)
        if attempt_step == 0 or offset == 0:
            order = epoch_order(epoch, size, args.seed)
        chunk = order[offset:offset + global_batch]  # the epoch's last chunk may be short
        mine = chunk.tensor_split(world)[rank]
        state["lr_scale"] = warmed_up_scale(attempt_step - warm_from, start_scale, target_scale, args.warmup_steps)
        lr = args.lr * state["lr_scale"] * decay(state["samples"] / total)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        # DDP averages gradients over the learners; scaled so, the result is the mean over the chunk.
        measure = not args.no_noise_scale and len(chunk) // world >= 2  # every learner has two halves
        parts = mine.tensor_split(2) if measure else (mine,)
        loss_sum, half_sq = 0.0, 0.0
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            # The first half's gradient stays local (no all-reduce); the last pass all-reduces the sum.
            with contextlib.nullcontext() if last or world == 1 else trained.no_sync():
                part_loss = nn.functional.cross_entropy(trained(train_x[part]), train_y[part], reduction="sum")
                (part_loss * world / len(chunk)).backward()
            loss_sum += part_loss.detach()
            if measure and i == 0:  # the mean gradient of this half, from its share of the chunk's mean
                half_sq = squared_grad_norm(model.parameters()) * (len(chunk) / (world * len(part))) ** 2
        whole_sq = squared_grad_norm(model.parameters()) if measure else 0.0
        optimizer.step()
        if args.sample_delay > 0:
            time.sleep(args.sample_delay * len(mine))
        state["samples"] += len(chunk)
        state["step"] += 1
        attempt_step += 1
        print(f"samples epoch={epoch} step={state['step']} rank={rank} idx={index_ranges(mine.tolist())}", flush=True)
        # One collective per step: the stop flag and a batch change asked of learner 0 travel with the
        # loss, so every learner stops, or switches, here.
        asked = changes.poll()
        stop, chunk_loss, half_sq_sum, half_sizes, *change = all_sum(
            float(STOP.requested), loss_sum.item(), half_sq, float(len(parts[0])) if measure else 0.0,
            *(asked.as_values() if asked else NO_CHANGE))
        change = BatchChange.from_values(change)
        if measure and half_sizes > 0:
            noise.update(half_sizes / world, half_sq_sum / world, len(chunk), whole_sq)
        if args.step_delay > 0 and not stop:
            time.sleep(args.step_delay)
        chunk_loss /= len(chunk)
        state["epoch_loss"] += chunk_loss * len(chunk)
        since_report += 1
        loss_since_report += chunk_loss
        epoch_done = state["samples"] % size == 0
        if rank == 0:
            print(f"step {state['step']} samples={state['samples']} loss {chunk_loss:.4f} lr {lr:.5f}", flush=True)
            if since_report >= args.report_every or epoch_done or stop:
                if args.noise_scale_schedule:
                    report(samples=state["samples"], loss=loss_since_report / since_report, step=state["step"],
                           noise_scale=scheduled(args.noise_scale_schedule, state["step"]))
                else:
                    noise.report(samples=state["samples"], loss=loss_since_report / since_report, step=state["step"])
                since_report, loss_since_report = 0, 0.0
        if change is not None and not stop:
            print(f"learner {rank}: global batch {global_batch} -> {change.global_batch} after step {state['step']} "
                  f"(lr factor -> {change.lr_scale:g}; no restart)", flush=True)
            global_batch, target_scale = change.global_batch, change.lr_scale
            start_scale, warm_from = state["lr_scale"], attempt_step
            changes.applied(change, step=state["step"])
        if epoch_done:
            finish_epoch(state, epoch, args.epochs, size, rank, model, val_x, val_y)
            checkpoint()
    elapsed = time.monotonic() - started
    if state["samples"] < total:
        checkpoint()
        print(f"learner {rank}: stop requested; checkpoint at samples={state['samples']} step {state['step']}; "
              f"exiting", flush=True)
        return finish()
    if rank == 0:
        val_acc = validation_accuracy(model, val_x, val_y)
        print(f"learner {rank}: done in {elapsed:.2f}s this attempt; final val_acc {val_acc:.4f}", flush=True)
        report(val_acc=val_acc, samples=state["samples"], step=state["step"])
        os.makedirs(result_dir, exist_ok=True)
        save_checkpoint(os.path.join(result_dir, "model.pt"), model.state_dict())
        with open(os.path.join(result_dir, "metrics.json"), "w") as out:
            json.dump({"history": state["history"], "val_acc": val_acc, "samples": state["samples"]}, out, indent=2)
    return finish()


def finish_epoch(state, epoch, epochs, size, rank, model, val_x, val_y):
    """The epoch's mean loss and validation accuracy, printed and reported by learner 0."""
    entry = {"epoch": epoch + 1, "loss": state["epoch_loss"] / size}
    state["epoch_loss"] = 0.0
    if rank == 0:
        entry["val_acc"] = validation_accuracy(model, val_x, val_y)
        print(f"epoch {epoch + 1}/{epochs} loss {entry['loss']:.4f} val_acc {entry['val_acc']:.4f}", flush=True)
        report(val_acc=entry["val_acc"], step=state["step"])
    state["history"].append(entry)


def finish():
    if dist.is_initialized():
        # Every learner gets here (they stop at the same step). Without the barrier the first to tear
        # down its connections can abort a peer still inside gloo.
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
