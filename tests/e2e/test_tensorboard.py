"""TensorBoard event files written by real learners, read into the job's metrics while they run
(`evaluation_metrics: {type: tensorboard}`), and charted on the job page in a real Chromium."""
import importlib.util
import pytest

from tests.support.optional import skip_or_fail
from tests.support.pages import WAIT_MS, log_in, shoot, wait_more, wait_status
from tests.support.submitting import manifest_with_command, metrics_of

pytestmark = pytest.mark.e2e

EXAMPLE = "tensorflow-tensorboard"
ACCURACY_CHART = "[data-testid=chart][data-metric='validation/accuracy']"
EPOCHS = 8


def needs(module, extra):
    if importlib.util.find_spec(module) is None:
        skip_or_fail(f"{module} is not installed (pip install -e '.[{extra}]')")


def series(points, name):
    return sorted((p["step"], p["value"]) for p in points if p["name"] == name)


@pytest.mark.browser
def test_the_tensorflow_examples_summaries_show_live_on_the_job_page(browser, live_platform):
    needs("tensorflow", "frameworks")
    # A pause after each epoch, so the chart is seen growing while the job runs.
    job = live_platform.submit(EXAMPLE, manifest_text=manifest_with_command(
        EXAMPLE, f"python train.py --epochs {EPOCHS} --epoch-pause 1.5"))
    page = log_in(browser, live_platform.url, live_platform.username, live_platform.password)
    page.set_default_timeout(WAIT_MS * 2)
    page.goto(f"{live_platform.url}/jobs/{job['id']}/")
    wait_status(page, "PROCESSING")
    first = wait_more(page, ACCURACY_CHART, "data-point-count", 0)
    assert live_platform.job(job["id"])["status"] == "PROCESSING"  # charted while it runs
    assert wait_more(page, ACCURACY_CHART, "data-point-count", first) > first  # and growing, over the websocket
    wait_status(page, "COMPLETED")
    page.wait_for_function("([sel, n]) => Number(document.querySelector(sel).getAttribute('data-point-count')) === n",
                           arg=[ACCURACY_CHART, EPOCHS])
    for metric in ("train/loss", "validation/loss"):
        assert page.locator(f"[data-testid=chart][data-metric='{metric}']").count() == 1
    shoot(page, "tensorboard-job-page.png")

    points = metrics_of(live_platform, job["id"])
    accuracy = series(points, "validation/accuracy")
    assert [step for step, _ in accuracy] == list(range(1, EPOCHS + 1))  # each epoch exactly once
    assert accuracy[-1][1] > 0.9 and all(0 <= v <= 1 for _, v in accuracy)
    train_loss = series(points, "train/loss")
    assert len(train_loss) == -(-1437 // 32) * EPOCHS // 10 and train_loss[-1][1] < train_loss[0][1]
    assert len({(p["name"], p["step"]) for p in points}) == len(points)  # nothing twice
    lines = [line["line"] for line in live_platform.all_logs(job["id"])]
    assert f"epoch {EPOCHS}/{EPOCHS} val_loss" in "\n".join(lines)
    assert not any(line.startswith("learner agent: TensorBoard") for line in lines)  # nothing to complain about


# torch.utils.tensorboard's SummaryWriter: simple_value scalars (TensorBoard's oldest encoding), a
# histogram and text that are not scalars, add_scalars' extra runs, and the default folder $LOG_DIR/tb.
TORCH_WRITER = """
import math, os
import torch
from torch.utils.tensorboard import SummaryWriter
writer = SummaryWriter(os.path.join(os.environ["LOG_DIR"], "tb"), flush_secs=1)
for step in range(25):
    writer.add_scalar("Loss/train", 1.0 / (step + 1), step)
    writer.add_scalars("lr", {"group0": 0.1 * 0.9 ** step}, step)
    if step % 10 == 0:
        writer.add_histogram("weights", torch.arange(100.0), step)
        writer.add_text("note", f"step {step}", step)
writer.close()
print("wrote 25 steps")
"""
TORCH_MANIFEST = """
name: torch-summary-writer
framework: {name: pytorch, command: python write.py}
memory: 2GiB
evaluation_metrics: {type: tensorboard}
"""


def test_torch_summary_writers_scalars_become_metrics_exactly_once(live_platform, tmp_path):
    needs("torch", "ml")
    needs("tensorboard", "ml")
    code = tmp_path / "torch-writer"
    code.mkdir()
    (code / "write.py").write_text(TORCH_WRITER)
    job = live_platform.submit(str(code), manifest_text=TORCH_MANIFEST)
    done = live_platform.wait_for(job["id"], timeout=240)
    assert done["status"] == "COMPLETED", done["status_reason"]
    points = metrics_of(live_platform, job["id"])
    assert series(points, "Loss/train") == [(s, pytest.approx(1.0 / (s + 1))) for s in range(25)]
    # add_scalars writes each series into a run folder of its own: lr_group0/.
    lr = [name for name in {p["name"] for p in points} if name.startswith("lr_group0/")]
    assert lr == ["lr_group0/lr"] and len(series(points, lr[0])) == 25
    assert {p["name"] for p in points} == {"Loss/train", "lr_group0/lr"}  # no histogram, no text
    assert len(points) == 50


# Keras' TensorBoard callback: epoch_* scalars in train/ and validation/, plus a graph event (not a scalar).
KERAS_CALLBACK = """
import os
import numpy as np, keras
rng = np.random.default_rng(0)
x = rng.random((256, 8), dtype=np.float32)
y = (x.sum(axis=1) > 4).astype("int32")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
model.fit(x, y, epochs=3, validation_split=0.25, verbose=0,
          callbacks=[keras.callbacks.TensorBoard(os.path.join(os.environ["LOG_DIR"], "tb"))])
"""


def test_keras_tensorboard_callbacks_epoch_scalars_become_metrics(live_platform, tmp_path):
    needs("tensorflow", "frameworks")
    code = tmp_path / "keras-callback"
    code.mkdir()
    (code / "fit.py").write_text(KERAS_CALLBACK)
    job = live_platform.submit(str(code), manifest_text=(
        "name: keras-callback\nframework: {name: keras, command: python fit.py}\nmemory: 3GiB\n"
        "evaluation_metrics: {type: tensorboard, in: '$JOB_STATE_DIR/logs/tb'}\n"))
    done = live_platform.wait_for(job["id"], timeout=240)
    assert done["status"] == "COMPLETED", done["status_reason"]
    points = metrics_of(live_platform, job["id"])
    for name in ("train/epoch_loss", "train/epoch_accuracy", "validation/epoch_loss", "validation/epoch_accuracy"):
        assert [step for step, _ in series(points, name)] == [0, 1, 2], name
