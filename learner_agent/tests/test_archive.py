"""Code archives: what is refused, and what a good one unpacks to."""
import dataclasses
import io
import os
import stat
import struct
import tarfile
import tracemalloc
import zipfile

import pytest

from learner_agent import archive, diskwatch
from learner_agent.archive import ArchiveError, extract_archive, inspect_archive
from tests.support.bombs import tar_bomb

LIMITS = {"max_unpacked_bytes": 10 * 10**6, "max_members": 100}


def make_zip(path, files, *, compression=zipfile.ZIP_DEFLATED):
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        for name, content in files.items():
            zf.writestr(name, content)
    return str(path)


def make_tar(path, members, *, mode="w:gz"):
    """members: (TarInfo kwargs, content bytes or None)."""
    with tarfile.open(path, mode) as tf:
        for fields, content in members:
            info = tarfile.TarInfo(fields.pop("name"))
            for key, value in fields.items():
                setattr(info, key, value)
            if content is not None:
                info.size = len(content)
            tf.addfile(info, io.BytesIO(content) if content is not None else None)
    return str(path)


def file_member(name, content=b"x", mode=0o644):
    return {"name": name, "mode": mode}, content


def assert_refused(path, tmp_path, match, **limits):
    limits = {**LIMITS, **limits}
    with pytest.raises(ArchiveError, match=match):
        inspect_archive(path, **limits)
    dest = tmp_path / "dest"
    with pytest.raises(ArchiveError, match=match):
        extract_archive(path, dest, **limits)
    assert_nothing_left(tmp_path, dest)


def assert_nothing_left(tmp_path, dest):
    assert not dest.exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".unpacking")]


# --- refused ---

def test_it_refuses_zip_slip(tmp_path):
    path = make_zip(tmp_path / "a.zip", {"ok.txt": "fine", "../x": "escape"})
    assert_refused(path, tmp_path, r"'\.\./x'.*\.\.")
    assert not (tmp_path / "x").exists()


def test_it_refuses_zip_slip_hidden_in_the_middle_and_with_backslashes(tmp_path):
    assert_refused(make_zip(tmp_path / "a.zip", {"a/../../x": "escape"}), tmp_path, r"a/\.\./\.\./x")
    assert_refused(make_zip(tmp_path / "b.zip", {"..\\x": "escape"}), tmp_path, r"\.\.")


def test_it_refuses_absolute_paths(tmp_path):
    assert_refused(make_zip(tmp_path / "a.zip", {"/etc/evil": "x"}), tmp_path, "'/etc/evil': absolute")
    tar = make_tar(tmp_path / "a.tgz", [file_member("/etc/evil")])
    assert_refused(tar, tmp_path, "'/etc/evil': absolute")


def test_it_refuses_tar_slip(tmp_path):
    assert_refused(make_tar(tmp_path / "a.tgz", [file_member("../x")]), tmp_path, r"'\.\./x'")


@pytest.mark.parametrize("fields, match", [
    ({"type": tarfile.SYMTYPE, "linkname": "/etc/passwd"}, "symbolic link"),
    ({"type": tarfile.SYMTYPE, "linkname": "inside.txt"}, "symbolic link"),
    ({"type": tarfile.LNKTYPE, "linkname": "inside.txt"}, "hard link"),
    ({"type": tarfile.CHRTYPE, "devmajor": 1, "devminor": 3}, "device"),
    ({"type": tarfile.FIFOTYPE}, "FIFO"),
])
def test_it_refuses_tar_links_and_special_files(tmp_path, fields, match):
    path = make_tar(tmp_path / "a.tgz", [file_member("inside.txt"), ({"name": "link", **fields}, None)])
    assert_refused(path, tmp_path, f"'link': .*{match}")


def test_it_refuses_zip_symlinks(tmp_path):
    path = tmp_path / "a.zip"
    with zipfile.ZipFile(path, "w") as zf:
        info = zipfile.ZipInfo("link")
        info.create_system = 3
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, "/etc/passwd")
    assert_refused(str(path), tmp_path, "'link': is a symbolic link")


def test_it_refuses_more_than_the_declared_size_limit(tmp_path):
    # 50 MB of zeros compresses to ~50 KB: the ratio is fine, the size is not.
    path = make_zip(tmp_path / "zeros.zip", {"zeros.bin": b"\0" * (50 * 10**6)})
    assert os.path.getsize(path) < 10**6
    assert_refused(path, tmp_path, "more than 10000000 bytes")


def test_it_refuses_a_bomb_whose_headers_lie(tmp_path):
    path = make_zip(tmp_path / "bomb.zip", {"zeros.bin": b"\0" * (50 * 10**6)})
    understate_zip_sizes(path, "zeros.bin", 1000)
    assert inspect_archive(path, **LIMITS).unpacked_bytes == 1000  # the headers alone look harmless
    dest = tmp_path / "dest"
    with pytest.raises(ArchiveError, match="zeros.bin"):
        extract_archive(path, dest, **LIMITS)
    assert_nothing_left(tmp_path, dest)


def test_it_counts_the_bytes_it_writes_not_the_headers(tmp_path, monkeypatch):
    # Whatever a decoder would let through for a lying header, the write loop stops at the limit.
    path = make_zip(tmp_path / "big.zip", {"a.bin": b"\0" * (6 * 10**6), "b.bin": b"\0" * (6 * 10**6)})
    real_entries = archive._zip_entries
    monkeypatch.setattr(archive, "_zip_entries",
                        lambda p: (dataclasses.replace(e, size=1) for e in real_entries(p)))
    dest = tmp_path / "dest"
    with pytest.raises(ArchiveError, match="'b.bin': .*more than 10000000 bytes"):
        extract_archive(path, dest, **LIMITS)
    assert_nothing_left(tmp_path, dest)


def test_it_allows_a_high_compression_ratio_under_the_limit(tmp_path):
    path = make_zip(tmp_path / "zeros.zip", {"zeros.bin": b"\0" * (9 * 10**6)})
    info = extract_archive(path, tmp_path / "dest", **LIMITS)
    assert info.unpacked_bytes == 9 * 10**6
    assert os.path.getsize(tmp_path / "dest" / "zeros.bin") == 9 * 10**6


def test_it_refuses_too_many_members(tmp_path):
    path = make_zip(tmp_path / "many.zip", {f"f{i}.txt": "x" for i in range(101)})
    assert_refused(path, tmp_path, "more than 100 members")
    tar = make_tar(tmp_path / "many.tgz", [file_member(f"f{i}.txt") for i in range(101)])
    assert_refused(tar, tmp_path, "more than 100 members")


def test_it_refuses_what_is_not_an_archive(tmp_path):
    path = tmp_path / "code.zip"
    path.write_text("print('hello')\n" * 100)
    assert_refused(str(path), tmp_path, "not a zip or tar archive")


def test_it_refuses_a_truncated_tar_gz(tmp_path):
    path = make_tar(tmp_path / "a.tgz", [file_member("big.bin", os.urandom(200_000))])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    assert_refused(path, tmp_path, "corrupt|not a zip or tar")


def test_it_leaves_nothing_behind_when_a_member_cannot_be_written(tmp_path):
    path = make_zip(tmp_path / "a.zip", {"a": "file", "a/b": "a file under a file"})
    dest = tmp_path / "dest"
    with pytest.raises(ArchiveError, match="'a/b': cannot be unpacked"):
        extract_archive(path, dest, **LIMITS)
    assert_nothing_left(tmp_path, dest)


def test_it_refuses_to_unpack_into_a_symlink_or_over_existing_files(tmp_path):
    path = make_zip(tmp_path / "a.zip", {"train.py": "x"})
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    with pytest.raises(FileExistsError):
        extract_archive(path, tmp_path / "link", **LIMITS)
    assert os.listdir(tmp_path / "elsewhere") == []
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old.txt").write_text("old")
    with pytest.raises(FileExistsError):
        extract_archive(path, tmp_path / "full", **LIMITS)


# --- accepted ---

def test_it_extracts_a_good_zip(tmp_path):
    path = tmp_path / "code.zip"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("project/", "")
        zf.writestr("project/train.py", "print('hi')\n")
        zf.writestr("project/pkg/model.py", "X = 1\n")
        run = zipfile.ZipInfo("project/run.sh")
        run.create_system = 3
        run.external_attr = (stat.S_IFREG | 0o755) << 16
        zf.writestr(run, "#!/bin/sh\n")
    (tmp_path / "dest").mkdir()  # an empty directory may already be there
    info = extract_archive(str(path), tmp_path / "dest", **LIMITS)
    assert info == archive.ArchiveInfo(kind="zip", members=4, files=3, unpacked_bytes=28)
    dest = tmp_path / "dest"
    assert os.listdir(dest) == ["project"]  # the single top-level directory is kept
    assert (dest / "project" / "train.py").read_text() == "print('hi')\n"
    assert (dest / "project" / "pkg" / "model.py").read_text() == "X = 1\n"
    assert os.access(dest / "project" / "run.sh", os.X_OK)
    assert not os.access(dest / "project" / "train.py", os.X_OK)
    assert_nothing_left(tmp_path, tmp_path / "nonexistent")


@pytest.mark.parametrize("mode, kind", [("w:gz", "tar.gz"), ("w", "tar")])
def test_it_extracts_a_good_tar_detected_by_content(tmp_path, mode, kind):
    path = make_tar(tmp_path / "code.bin", [({"name": "./", "type": tarfile.DIRTYPE, "mode": 0o755}, None),
                                            ({"name": "./src", "type": tarfile.DIRTYPE, "mode": 0o755}, None),
                                            file_member("./src/train.py", b"print(1)\n"),
                                            file_member("./run.sh", b"#!/bin/sh\n", mode=0o755)],
                    mode=mode)
    assert inspect_archive(path, **LIMITS) == archive.ArchiveInfo(kind=kind, members=3, files=2, unpacked_bytes=19)
    extract_archive(path, tmp_path / "dest", **LIMITS)
    dest = tmp_path / "dest"
    assert sorted(os.listdir(dest)) == ["run.sh", "src"]
    assert (dest / "src" / "train.py").read_bytes() == b"print(1)\n"
    assert os.access(dest / "run.sh", os.X_OK)



# --- inspection's bounds: what checking an archive may cost the submit request ---

BOUNDED = {"max_unpacked_bytes": 2**30, "max_members": 20000}


@pytest.fixture
def inflated(monkeypatch):
    """How many bytes the inspection read out of the gzip stream, in total."""
    counter = {"bytes": 0}
    real_open = archive.gzip.open

    class Counting:
        def __init__(self, raw):
            self.raw = raw

        def read(self, size=-1):
            data = self.raw.read(size)
            counter["bytes"] += len(data)
            return data

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.raw.close()

    monkeypatch.setattr(archive.gzip, "open", lambda *a, **k: Counting(real_open(*a, **k)))
    return counter


def test_a_bomb_of_one_member_is_refused_at_its_header(tmp_path, inflated):
    path = tar_bomb(tmp_path / "bomb.tgz", [256 * 2**20])
    assert os.path.getsize(path) < 2**20
    assert inspect_archive(path, **BOUNDED).unpacked_bytes == 256 * 2**20  # within the size limit alone
    inflated["bytes"] = 0
    with pytest.raises(ArchiveError, match=r"'zeros-0.bin': archive unpacks to at least 256.0 MiB from 0\.\d MiB: "
                                           r"more than 100 times its size"):
        inspect_archive(path, **BOUNDED, bounds=archive.InspectBounds(max_ratio=100))
    assert inflated["bytes"] < 2**20  # the header and the start of the data, nothing more


def test_a_bomb_of_many_members_is_refused_once_past_its_allowance(tmp_path, inflated):
    path = tar_bomb(tmp_path / "bomb.tgz", [2**20] * 200)
    with pytest.raises(ArchiveError, match="more than 100 times its size"):
        inspect_archive(path, **BOUNDED, bounds=archive.InspectBounds(max_ratio=100))
    assert inflated["bytes"] < 2 * archive.RATIO_FREE_BYTES  # of 200 MiB


def test_small_archives_are_never_refused_for_their_ratio(tmp_path):
    path = tar_bomb(tmp_path / "repetitive.tgz", [8 * 2**20])  # ratio ~1000, but only 8 MiB
    info = inspect_archive(path, **BOUNDED, bounds=archive.InspectBounds(max_ratio=100))
    assert info.unpacked_bytes == 8 * 2**20


def test_a_zip_is_judged_by_its_declared_sizes(tmp_path):
    path = make_zip(tmp_path / "bomb.zip", {"zeros.bin": b"\0" * (64 * 2**20)})
    with pytest.raises(ArchiveError, match="'zeros.bin': .*more than 100 times its size"):
        inspect_archive(path, **BOUNDED, bounds=archive.InspectBounds(max_ratio=100))


def test_what_tarfile_reads_by_itself_is_bounded_too(tmp_path, inflated):
    # A 64 MiB extended (pax) header: tarfile reads it whole into memory before any member is seen.
    path = tmp_path / "pax.tgz"
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo("small.txt")
        info.pax_headers = {"comment": "x" * (64 * 2**20)}
        tf.addfile(info, io.BytesIO(b""))
    with pytest.raises(ArchiveError, match="inflates to more than .* MiB, more than its size allows"):
        inspect_archive(str(path), max_unpacked_bytes=2**30, max_members=100,
                        bounds=archive.InspectBounds(max_ratio=100))
    assert inflated["bytes"] < 2 * archive.RATIO_FREE_BYTES


def test_inspection_gives_up_at_its_deadline(tmp_path, monkeypatch):
    path = make_tar(tmp_path / "code.tgz", [file_member(f"f{i}.py", b"x = 1\n") for i in range(50)])
    clock = iter(range(0, 1000, 1))  # every look at the clock is a second later
    monkeypatch.setattr(archive.time, "monotonic", lambda: next(clock))
    with pytest.raises(ArchiveError, match="took more than 5s to inspect"):
        inspect_archive(path, **BOUNDED, bounds=archive.InspectBounds(max_seconds=5))


def test_a_good_archive_passes_the_bounds(tmp_path):
    path = make_tar(tmp_path / "code.tgz", [file_member("train.py", b"print(1)\n" * 1000)])
    info = inspect_archive(path, **BOUNDED, bounds=archive.InspectBounds(max_ratio=100, max_seconds=15))
    assert info == archive.ArchiveInfo(kind="tar.gz", members=1, files=1, unpacked_bytes=9000)

# --- paths the agent could not unpack or measure ---

def test_it_refuses_folders_nested_deeper_than_the_agent_measures(tmp_path):
    # The agent fails a learner whose work folder nests past diskwatch.MAX_DEPTH: refused at submission.
    deep = "d/" * (diskwatch.MAX_DEPTH + 1) + "train.py"
    assert_refused(make_tar(tmp_path / "a.tgz", [file_member(deep)]), tmp_path,
                   f"nests {diskwatch.MAX_DEPTH + 1} folders deep; at most {diskwatch.MAX_DEPTH}")
    assert_refused(make_zip(tmp_path / "a.zip", {"d/" * (diskwatch.MAX_DEPTH + 1): ""}), tmp_path, "folders deep")


def test_folders_as_deep_as_the_agent_measures_unpack_and_measure(tmp_path):
    path = make_tar(tmp_path / "a.tgz", [file_member("d/" * diskwatch.MAX_DEPTH + "train.py")])
    extract_archive(path, tmp_path / "dest", **LIMITS)
    assert diskwatch.usage([tmp_path / "dest"]) > 0


@pytest.mark.parametrize("name, match", [
    ("\u00e9" * 128 + ".py", "a name in its path is 259 bytes long; at most 255"),  # 131 characters, 259 bytes
    ("/".join(["n" * 200] * 16), "path is 3,215 bytes long; at most 3072"),
])
def test_it_refuses_names_longer_than_a_file_system_takes(tmp_path, name, match):
    assert_refused(make_tar(tmp_path / "a.tgz", [file_member(name)]), tmp_path, match)
    assert_refused(make_zip(tmp_path / "a.zip", {name: "x"}), tmp_path, match)


def test_a_huge_name_is_cut_short_in_its_refusal(tmp_path):
    path = make_tar(tmp_path / "a.tgz", [file_member("x" * 2**20 + "/../evil"), file_member("link")])
    with pytest.raises(ArchiveError) as refused:
        inspect_archive(path, **LIMITS)
    message = str(refused.value)
    assert len(message) < 500, len(message)
    assert message.startswith("archive member 'xxx") and "... (1,048,584 characters)" in message
    assert refused.value.member == "x" * 2**20 + "/../evil"  # the whole name stays on the error


def test_a_huge_link_target_is_cut_short_in_its_refusal(tmp_path):
    path = make_tar(tmp_path / "a.tgz", [({"name": "link", "type": tarfile.SYMTYPE, "linkname": "t" * 2**20}, None)])
    with pytest.raises(ArchiveError, match=r"symbolic link \(to 't+'\.\.\. \(1,048,576 characters\)\)") as refused:
        inspect_archive(path, **LIMITS)
    assert len(str(refused.value)) < 500


# --- a zip's central directory, read within its member limit ---

def zip_of_entries(path, count, *, zip64=False, listed=None):
    """A zip whose central directory lists one empty file `count` times (what a 100 MiB upload of empty
    files holds a million of), its end record saying `listed` (default: `count`) entries."""
    local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, 0, 0, 0, 1, 0) + b"a"
    central = struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0) + b"a"
    listed = count if listed is None else listed
    directory_at, directory_bytes = len(local), len(central) * count
    tail = b""
    if zip64:
        tail = (struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, listed, listed, directory_bytes,
                            directory_at)
                + struct.pack("<4sLQL", b"PK\x06\x07", 0, directory_at + directory_bytes, 1))
        listed, directory_at, directory_bytes = 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, min(listed, 0xFFFF), min(listed, 0xFFFF), directory_bytes,
                      directory_at, 0)
    path.write_bytes(local + central * count + tail + end)
    return str(path)


@pytest.mark.parametrize("zip64", [False, True])
def test_a_zip_of_too_many_entries_is_refused_before_zipfile_reads_them(tmp_path, zip64):
    path = zip_of_entries(tmp_path / "many.zip", 60_000, zip64=zip64, listed=1)  # 2.8 MB; it says it holds 1
    tracemalloc.start()
    try:
        with pytest.raises(ArchiveError, match="more than 100 members"):
            inspect_archive(path, **LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak  # zipfile's object for each of 60,000 entries takes tens of MiB
    assert_refused(path, tmp_path, "more than 100 members")


@pytest.mark.parametrize("zip64", [False, True])
def test_a_zip_within_its_member_limit_is_read_as_before(tmp_path, zip64):
    path = zip_of_entries(tmp_path / "few.zip", 100, zip64=zip64)
    assert inspect_archive(path, **LIMITS).members == 100


def test_a_zip_with_a_comment_is_read_as_before(tmp_path):
    path = tmp_path / "commented.zip"
    with zipfile.ZipFile(path, "w") as zf:
        for i in range(100):
            zf.writestr(f"f{i}.py", "x = 1\n")
        zf.comment = b"a comment the end record is looked for behind " * 1000
    assert inspect_archive(str(path), **LIMITS).members == 100


def understate_zip_sizes(path, name, size):
    """Rewrite the uncompressed size of `name` in its local header and central directory entry."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        encoded = name.encode()
        local = data.find(b"PK\x03\x04")
        assert data[local + 30:local + 30 + len(encoded)] == encoded
        struct.pack_into("<I", data, local + 22, size)
        central = data.find(b"PK\x01\x02")
        assert data[central + 46:central + 46 + len(encoded)] == encoded
        struct.pack_into("<I", data, central + 24, size)
        f.seek(0)
        f.write(data)
