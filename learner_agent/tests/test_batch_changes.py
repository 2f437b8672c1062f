"""The learners' half of batch changes without a restart (learner_agent.batch_changes)."""
import json
import os

import pytest

from learner_agent.batch_changes import NO_CHANGE, BatchChange, BatchChanges, write_request

REQUEST = {"id": 5, "global_batch": 128, "local_batch": 64, "lr_scale": 2.0}


def metric_lines(capsys):
    return [json.loads(line.split(" ", 1)[1]) for line in capsys.readouterr().out.splitlines()]


def test_learner_0_says_it_listens_and_sees_each_change_once(tmp_path, capsys):
    path = str(tmp_path / "batch.json")
    changes = BatchChanges(path, rank=0)
    assert metric_lines(capsys) == [{"name": "batch_changes", "value": 1.0}]
    assert changes.poll() is None  # nothing asked yet
    write_request(path, dict(REQUEST, extra="ignored"))
    change = changes.poll()
    assert change == BatchChange(5, 128, 64, 2.0)
    assert changes.poll() == change  # asked until applied
    changes.applied(change, step=30)
    assert metric_lines(capsys) == [{"name": "batch_applied", "value": 5.0, "step": 30}]
    assert changes.poll() is None
    write_request(path, dict(REQUEST, id=6, global_batch=256, local_batch=128))
    assert changes.poll().global_batch == 256


def test_other_learners_neither_announce_nor_read(tmp_path, capsys):
    path = str(tmp_path / "batch.json")
    write_request(path, REQUEST)
    changes = BatchChanges(path, rank=1)
    assert changes.poll() is None
    changes.applied(BatchChange(5, 128, 64, 2.0))
    assert capsys.readouterr().out == ""


def test_outside_the_platform_nothing_is_asked(monkeypatch, capsys):
    monkeypatch.delenv("TRAINYARD_BATCH_CONTROL", raising=False)
    assert BatchChanges(rank=0).poll() is None
    assert capsys.readouterr().out == ""  # no announcement: no platform to hear it


@pytest.mark.parametrize("content", ["{half", "[]", '{"id": 0, "global_batch": 1, "local_batch": 1, "lr_scale": 1}',
                                     '{"id": 3, "global_batch": true, "local_batch": 1, "lr_scale": 1}',
                                     '{"id": 3, "global_batch": 8, "local_batch": 8, "lr_scale": "NaN"}'])
def test_an_unreadable_or_foreign_file_is_no_change_and_is_read_again(tmp_path, content, capsys):
    path = tmp_path / "batch.json"
    path.write_text(content)
    changes = BatchChanges(str(path), rank=0)
    assert changes.poll() is None
    write_request(str(path), REQUEST)
    os.utime(path, ns=(1, 1))  # even at the old time stamp: its size and inode differ
    assert changes.poll() == BatchChange(5, 128, 64, 2.0)


def test_a_change_travels_between_learners_as_a_sum_with_zeros():
    change = BatchChange(9, 96, 32, 1.5)
    summed = [a + b + c for a, b, c in zip(change.as_values(), NO_CHANGE, NO_CHANGE)]
    assert BatchChange.from_values(summed) == change
    assert BatchChange.from_values(NO_CHANGE) is None


def test_the_agent_writes_a_request_whole(tmp_path):
    path = tmp_path / "batch.json"
    write_request(str(path), dict(REQUEST, more="x"))
    assert json.loads(path.read_text()) == REQUEST
    assert sorted(os.listdir(tmp_path)) == ["batch.json"]
