"""What examples/pytorch-elastic prints, read back: the patterns of its log lines and the accuracy it
must reach, shared by its test without the platform (tests/examples) and on it (tests/e2e)."""
import collections
import re

# Final validation accuracy of the elastic run against the same job at a fixed size: 360 digits, so
# 0.03 is 11 of them (measured: docs/elastic.md, "Elastic jobs").
ACCURACY_TOLERANCE = 0.03

SAMPLES_LINE = re.compile(r"^samples epoch=(\d+) step=(\d+) rank=(\d+) idx=([\d.,]*)$")
STEP_LINE = re.compile(r"^step (\d+) samples=(\d+) loss ([\d.]+) lr ([\d.]+)$")
STOP_LINE = re.compile(r"^learner (\d+): stop requested; checkpoint at samples=(\d+) step (\d+); exiting$")
TRAINING_SET = re.compile(r"^learner 0 of \d+: (\d+) training digits")
FINAL_LINE = re.compile(r"final val_acc ([\d.]+)$")
TOTAL = re.compile(r"epochs = (\d+) samples$")


def expand(ranges):
    """`"3,17..19"` -> [3, 17, 18, 19]: the inverse of the example's log format."""
    indices = []
    for part in filter(None, ranges.split(",")):
        first, _, last = part.partition("..")
        indices.extend(range(int(first), int(last or first) + 1))
    return indices


def assert_every_sample_once(lines, epochs):
    """Over all attempts and batch sizes, the job's log lines (API entries) show every training sample
    used exactly once in each of its `epochs`."""
    size = int(next(m.group(1) for e in lines if (m := TRAINING_SET.search(e["line"]))))
    seen = collections.defaultdict(collections.Counter)
    for entry in lines:
        if m := SAMPLES_LINE.match(entry["line"]):
            seen[int(m.group(1))].update(expand(m.group(4)))
    assert sorted(seen) == list(range(epochs))
    for epoch, counts in seen.items():
        repeated = sorted(i for i, n in counts.items() if n != 1)
        missing = sorted(set(range(size)) - set(counts))
        assert not repeated and not missing, (epoch, repeated[:10], missing[:10])
