"""TensorBoard scalars through the ingest protocol: what tensorboard reads, exactly once, and nothing
a hostile record can break.

The event files are written by the tensorboard package's own writer and read by the agent's tailer
(learner_agent.tfevents), as on a real learner; the records it ships are posted to ingest."""
import base64

import numpy as np
import pytest

from jobs import tensorboard
from jobs.models import Learner, LogLine, MetricPoint
from learner_agent import tfevents
from tests.support.builders import post

tb = pytest.importorskip("tensorboard")
from tensorboard.compat.proto import event_pb2, summary_pb2  # noqa: E402
from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: E402
from tensorboard.util import tensor_util  # noqa: E402

pytestmark = pytest.mark.django_db


def simple(tag, value, step):
    return event_pb2.Event(wall_time=1_700_000_000.0 + step, step=step, summary=summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)]))


def tf2_scalar(tag, value, step, *, first):
    """What TF2's tf.summary.scalar writes: a 0-d tensor; the plugin's metadata on the tag's first value only."""
    metadata = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
                                           data_class=summary_pb2.DATA_CLASS_SCALAR) if first else None
    value_proto = summary_pb2.Summary.Value(tag=tag, tensor=tensor_util.make_tensor_proto(np.float32(value)))
    if metadata is not None:
        value_proto.metadata.CopyFrom(metadata)
    return event_pb2.Event(wall_time=1_700_000_000.0 + step, step=step, summary=summary_pb2.Summary(value=[value_proto]))


def histogram(tag, step):
    metadata = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="histograms"))
    value = summary_pb2.Summary.Value(tag=tag, metadata=metadata,
                                      tensor=tensor_util.make_tensor_proto(np.zeros((3, 3), np.float64)))
    return event_pb2.Event(step=step, summary=summary_pb2.Summary(value=[value]))


def write(folder, events):
    folder.mkdir(parents=True, exist_ok=True)
    writer = EventFileWriter(str(folder))
    for event in events:
        writer.add_event(event)
    writer.close()


class Agent:
    """The agent's half: a tailer over `root`, numbering what it ships as the shipper would."""

    def __init__(self, root, state, seq=0):
        self.root, self.state, self.seq, self.outbox = root, state, seq, []

    def read(self):
        tailer = tfevents.EventFileTailer(str(self.root), [], state_dir=str(self.state), ship=self._ship,
                                          notice=lambda text: None)
        tailer.drain()
        batch, self.outbox = self.outbox, []
        return batch

    def _ship(self, records):
        for record in records:
            self.seq += 1
            self.outbox.append({"seq": self.seq, "time": 1.0, **record})


def points(name=None):
    rows = MetricPoint.objects.order_by("id")
    rows = rows.filter(name=name) if name else rows
    return [(p.name, p.step, round(p.value, 5)) for p in rows]


def test_it_charts_each_writers_scalars_by_run_and_tag(running_job, tmp_path):
    root = tmp_path / "tb"
    write(root / "train", [simple("loss", 1.0 / (s + 1), s) for s in range(3)] + [histogram("weights", 3)])
    write(root / "validation", [tf2_scalar("epoch_accuracy", 0.5 + s / 10, s, first=s == 0) for s in range(3)])
    (tmp_path / "agent").mkdir()
    records = Agent(root, tmp_path / "agent").read()
    assert post(running_job, records).json() == {"acked": len(records)}
    assert points("train/loss") == [("train/loss", s, round(1.0 / (s + 1), 5)) for s in range(3)]
    # Later values of a TF2 tag carry no metadata: the run's first one said it is a scalar.
    assert points("validation/epoch_accuracy") == [("validation/epoch_accuracy", s, 0.5 + s / 10) for s in range(3)]
    assert {p[0] for p in points()} == {"train/loss", "validation/epoch_accuracy"}  # no histogram
    first = MetricPoint.objects.filter(name="train/loss").order_by("step").first()
    assert first.time.timestamp() == 1_700_000_000.0  # the event's own wall time


def test_a_record_sent_again_by_a_restarted_agent_is_stored_once(running_job, tmp_path):
    root, state = tmp_path / "tb", tmp_path / "agent"
    state.mkdir()
    write(root, [simple("loss", s, s) for s in range(5)])
    offsets = state / tfevents.OFFSETS_FILE
    first = Agent(root, state)
    batch = first.read()
    post(running_job, batch)
    # The agent died after spooling those records but before it wrote its offsets: the next one
    # reads them again, numbered after the first agent's.
    offsets.unlink()
    write(root / "later", [simple("loss", 9, 9)])
    again = Agent(root, state, seq=first.seq).read()
    assert len(again) == len(batch) + 2  # everything again, plus the new file's two records
    assert post(running_job, again).json() == {"acked": first.seq + len(again)}
    assert points() == [("loss", s, s) for s in range(5)] + [("later/loss", 9, 9)]
    stored = Learner.objects.get(job=running_job).ingest_state
    assert set(stored["offsets"]) == {r["file"] for r in again} and stored["tags"][""] == {"loss": True}


def test_hostile_records_are_noted_and_break_nothing(running_job):
    huge_shape = summary_pb2.Summary.Value(tag="bomb", tensor=tensor_util.make_tensor_proto(np.float32(1.0)))
    huge_shape.tensor.tensor_shape.dim.add(size=10**9)
    huge_shape.tensor.tensor_shape.dim.add(size=10**9)
    huge_shape.metadata.plugin_data.plugin_name = "scalars"
    bomb = event_pb2.Event(step=1, summary=summary_pb2.Summary(value=[huge_shape])).SerializeToString()
    nan = simple("nan", float("nan"), 2).SerializeToString()
    long_tag = simple("t" * (tensorboard.MAX_TAG + 1), 1.0, 3).SerializeToString()

    def record(seq, data, **extra):
        return {"seq": seq, "kind": "tfevent", "file": "f", "offset": seq * 100, "time": 1.0,
                "data": base64.b64encode(data).decode(), **extra}

    records = [record(1, b"\xff\xff\xff not a protobuf"), record(2, bomb), record(3, long_tag),
               {**record(4, b""), "data": "%%% not base64"}, {**record(5, b""), "file": None},
               {**record(6, b""), "data": "A" * (tensorboard.MAX_RECORD_BYTES * 2)},
               record(7, simple("ok", 1.5, 7).SerializeToString()), record(8, nan)]
    assert post(running_job, records).json() == {"acked": 8}
    assert points() == [("ok", 7, 1.5)]
    assert Learner.objects.get(job=running_job).ingest_state["tags"] == {"": {"bomb": True, "ok": True, "nan": True}}
    notes = list(LogLine.objects.filter(stream="system").order_by("seq").values_list("line", flat=True))
    assert len(notes) == 4 and all(n.startswith("TensorBoard: ") for n in notes)
    assert "f byte 100: not an Event protobuf" in notes[0]
    assert "not base64" in notes[1] and "its file's path" in notes[2] and "at most" in notes[3]


def event_record(seq, file, event):
    """An agent's tfevent record of `event` from `file`, at an offset of its own."""
    return {"seq": seq, "kind": "tfevent", "file": file, "offset": seq * 100, "time": 1.0,
            "data": base64.b64encode(event.SerializeToString()).decode()}


def test_a_nul_in_a_tag_or_a_file_name_is_passed_over_and_the_batch_stored(running_job):
    # PostgreSQL keeps no NUL in JSON or text: either one failed the whole post (a 500 the agent retries
    # for good), so none of the learner's log came in after it.
    records = [event_record(1, "f", simple("lo\x00ss", 1.0, 1)),
               event_record(2, "tr\x00ain/f", simple("loss", 2.0, 2)), event_record(3, "f", simple("loss", 3.0, 3)),
               {"seq": 4, "kind": "log", "stream": "stdout", "line": "after"}]
    assert post(running_job, records).json() == {"acked": 4}
    assert points() == [("loss", 3, 3.0)]
    assert Learner.objects.get(job=running_job).ingest_state["tags"] == {"": {"loss": True}}
    assert "its file's path: at most" in LogLine.objects.get(stream="system").line
    assert LogLine.objects.filter(stream="stdout", line="after").exists()


def test_notes_stop_at_the_limit(running_job):
    records = [{"seq": s, "kind": "tfevent", "file": "f", "offset": s, "time": 1.0,
                "data": base64.b64encode(b"\xff garbage").decode()} for s in range(1, 40)]
    post(running_job, records)
    notes = list(LogLine.objects.filter(stream="system").order_by("seq").values_list("line", flat=True))
    assert len(notes) == tensorboard.MAX_NOTES and "the last such note" in notes[-1]


def test_an_event_gives_one_value_per_tag(running_job, settings):
    repeated = event_pb2.Event(wall_time=1_700_000_000.0, step=1, summary=summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag="loss", simple_value=float(i)) for i in range(5000)]))
    records = [{"seq": s, "kind": "tfevent", "file": "f", "offset": s * 100_000, "time": 1.0,
                "data": base64.b64encode(repeated.SerializeToString()).decode()} for s in (1, 2)]
    assert post(running_job, records).json() == {"acked": 2}
    assert points() == [("loss", 1, 0.0), ("loss", 1, 0.0)]


def test_tags_and_runs_that_are_not_printable_are_passed_over(running_job):
    def record(seq, file, tag):
        return {"seq": seq, "kind": "tfevent", "file": file, "offset": seq, "time": 1.0,
                "data": base64.b64encode(simple(tag, 1.0, seq).SerializeToString()).decode()}

    records = [record(1, "f", "\x1b[2J\x1b[31mloss\r\nfake line"), record(2, "f", "lo\u202ess"),
               record(3, "r\x07un\n/f", "loss"), record(4, "f", "loss")]
    assert post(running_job, records).json() == {"acked": 4}
    assert points() == [("loss", 4, 1.0)]


def test_event_points_count_against_the_learners_metric_cap(running_job, settings):
    settings.METRIC_POINTS_PER_LEARNER = 3
    records = [{"seq": s, "kind": "tfevent", "file": "f", "offset": s, "time": 1.0,
                "data": base64.b64encode(simple("loss", float(s), s).SerializeToString()).decode()}
               for s in range(1, 11)]
    assert post(running_job, records).json() == {"acked": 10}
    assert [step for _, step, _ in points()] == [1, 2, 3]
    assert LogLine.objects.get(stream="system").line.startswith("metric cap reached for learner 0")


def test_a_file_name_that_is_not_utf8_is_passed_over_and_the_batch_stored(running_job):
    # A learner may name an event file with bytes that are no UTF-8 (b"ev\xff.tfevents"): the agent
    # reads the name as a lone surrogate, which PostgreSQL keeps in no JSON, so the learner's memory of
    # its files failed the whole post (a 500 the agent retries for good).
    records = [event_record(1, "ev\udcff.tfevents", simple("loss", 1.0, 1)),
               event_record(2, "r\udcffun/f", simple("loss", 2.0, 2)), event_record(3, "f", simple("loss", 3.0, 3)),
               {"seq": 4, "kind": "log", "stream": "stdout", "line": "after"}]
    assert post(running_job, records).json() == {"acked": 4}
    assert points() == [("loss", 3, 3.0)]
    assert set(Learner.objects.get(job=running_job).ingest_state["offsets"]) == {"f"}
    assert LogLine.objects.filter(stream="stdout", line="after").exists()
