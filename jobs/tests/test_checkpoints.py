import io
import os
import struct
import time
import zipfile

import pytest

from jobs import checkpoints


def zip_file(path, size=1000):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("data.pkl", os.urandom(size))
    return path


@pytest.mark.parametrize("name, make, complete", [
    ("epoch-1.pt", lambda p: zip_file(p), True),
    ("epoch-1.pt", lambda p: p.write_bytes(zip_file(io.BytesIO()).getvalue()[:-30]), False),  # cut short
    ("epoch-1.pt", lambda p: p.write_bytes(b"\x80\x02legacy pickle"), True),  # not a zip: cannot be checked
    ("model.h5", lambda p: p.write_bytes(b"\x89HDF..."), True),
    (".epoch-1.pt.tmp-42", lambda p: zip_file(p), False),
    ("epoch-1.pt.partial", lambda p: zip_file(p), False),
    ("empty.ckpt", lambda p: p.write_bytes(b""), False),
    # torch.save writes a zip whatever the name: one cut short is told by its content, not its suffix
    ("checkpoint.pth.tar", lambda p: p.write_bytes(zip_file(io.BytesIO()).getvalue()[:-30]), False),
    ("checkpoint.pth.tar", lambda p: zip_file(p), True),
    ("pytorch_model.bin", lambda p: p.write_bytes(zip_file(io.BytesIO()).getvalue()[:200]), False),
    ("x.pt", lambda p: p.write_bytes(b"PK"), False),  # the first bytes of a zip, and nothing more
    ("notes.txt", lambda p: p.write_bytes(b"ok\n"), True),
    ("model.safetensors", lambda p: p.write_bytes(struct.pack("<Q", 2) + b"{}" + b"\0" * 16), True),
    ("model.safetensors", lambda p: p.write_bytes(struct.pack("<Q", 400) + b'{"w": '), False),  # cut short
])
def test_it_tells_complete_checkpoints_from_cut_short_ones(tmp_path, name, make, complete):
    path = tmp_path / name
    make(path)
    assert checkpoints.is_complete(path) is complete


def write(job, attempt, name, age):
    folder = checkpoints.attempt_dir(job, attempt)
    folder.mkdir(parents=True, exist_ok=True)
    path = zip_file(folder / name)
    stamp = time.time() - age
    os.utime(path, (stamp, stamp))
    return path


def test_last_good_is_the_newest_complete_one_of_the_latest_attempt_that_has_one(tmp_path):
    write(tmp_path, 1, "epoch-1.pt", age=30)
    good = write(tmp_path, 2, "epoch-2.pt", age=20)
    broken = checkpoints.attempt_dir(tmp_path, 2) / "epoch-3.pt"
    broken.write_bytes(b"PK\x03\x04 truncated")
    assert checkpoints.last_good(tmp_path, before_attempt=3) == good
    assert checkpoints.last_good(tmp_path, before_attempt=2).name == "epoch-1.pt"
    assert checkpoints.last_good(tmp_path, before_attempt=1) is None


def test_retention_keeps_the_newest_per_attempt(tmp_path):
    for epoch in range(1, 8):
        write(tmp_path, 1, f"epoch-{epoch}.pt", age=100 - epoch)
    removed = checkpoints.apply_retention(tmp_path, 1, keep=3)
    assert sorted(p.name for p in removed) == [f"epoch-{e}.pt" for e in range(1, 5)]
    assert sorted(p.name for p in checkpoints.attempt_dir(tmp_path, 1).iterdir()) == [
        "epoch-5.pt", "epoch-6.pt", "epoch-7.pt"]


def test_a_folder_filled_with_files_costs_a_bounded_look(tmp_path, monkeypatch):
    # A learner may leave a million files among its checkpoints; every store, halt and deploy scanned
    # and opened them all, on a worker every tenant shares.
    folder = checkpoints.attempt_dir(tmp_path, 1)
    folder.mkdir(parents=True)
    for index in range(60):
        (folder / f"junk-{index}.pt").write_bytes(b"PK\x03\x04 junk")
    newest = write(tmp_path, 1, "epoch-9.pt", age=-10)
    opened = []
    monkeypatch.setattr(checkpoints, "MAX_FILES", 100)
    monkeypatch.setattr(checkpoints, "is_complete", lambda path, check=checkpoints.is_complete: opened.append(path)
                        or check(path))
    assert checkpoints.last_good(tmp_path, before_attempt=2) == newest and opened == [newest]
    monkeypatch.setattr(checkpoints, "MAX_CHECKED", 20)
    opened.clear()
    checkpoints.apply_retention(tmp_path, 1, keep=1)
    assert len(opened) <= 20


def saved_as_a_folder(job, attempt, name, age, files=7):
    """A checkpoint of several files in a folder of its own, as Hugging Face's Trainer saves one."""
    folder = checkpoints.attempt_dir(job, attempt) / name
    folder.mkdir(parents=True)
    stamp = time.time() - age
    for index in range(files):
        path = zip_file(folder / f"part-{index}.bin") if index % 2 else folder / f"part-{index}.json"
        if not index % 2:
            path.write_text("{}")
        os.utime(path, (stamp + index, stamp + index))
    return folder


def test_a_checkpoint_saved_as_a_folder_is_kept_and_resumed_from_whole(tmp_path):
    """Retention counted files: keeping the newest five deleted the older parts of the newest
    checkpoint, and RESUME_FROM named one of its files."""
    saved_as_a_folder(tmp_path, 1, "checkpoint-100", age=100)
    newest = saved_as_a_folder(tmp_path, 1, "checkpoint-200", age=50)
    removed = checkpoints.apply_retention(tmp_path, 1, keep=1)
    assert [path.name for path in removed] == ["checkpoint-100"]
    assert [path.name for path in checkpoints.attempt_dir(tmp_path, 1).iterdir()] == ["checkpoint-200"]
    assert len(list(newest.iterdir())) == 7
    assert checkpoints.last_good(tmp_path, before_attempt=2) == newest
    assert checkpoints.written_at(newest) == max(path.stat().st_mtime for path in newest.iterdir())


def test_a_folder_with_a_part_cut_short_or_still_being_written_is_not_resumed_from(tmp_path):
    good = saved_as_a_folder(tmp_path, 1, "checkpoint-100", age=100)
    torn = saved_as_a_folder(tmp_path, 1, "checkpoint-200", age=50)
    (torn / "part-1.bin").write_bytes((torn / "part-1.bin").read_bytes()[:-30])
    assert checkpoints.last_good(tmp_path, before_attempt=2) == good
    writing = saved_as_a_folder(tmp_path, 1, "checkpoint-300", age=10)
    (writing / "optimizer.pt.tmp").write_bytes(b"half")
    assert checkpoints.last_good(tmp_path, before_attempt=2) == good
