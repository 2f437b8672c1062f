"""Packing a code folder: what the client sends is an archive the platform accepts."""
import io
import os
import tarfile

from learner_agent.archive import inspect_archive
from trainyard import packing


def test_it_packs_hard_linked_files_as_copies(tmp_path):
    # Trees of hard links are common (pip's and conda's caches, `cp -al` snapshots); the platform
    # refuses a hard link member, so each name is sent as a file of its own.
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print('train')\n")
    os.link(code / "train.py", code / "same.py")
    out = io.BytesIO()
    packing.pack_directory(code, out)
    with tarfile.open(fileobj=out, mode="r:gz") as tar:
        members = {member.name: member for member in tar.getmembers()}
        assert set(members) == {"same.py", "train.py"}
        assert all(member.isfile() for member in members.values())
        assert tar.extractfile(members["same.py"]).read() == b"print('train')\n"
    archive = tmp_path / "code.tar.gz"
    archive.write_bytes(out.getvalue())
    info = inspect_archive(archive, max_unpacked_bytes=10**7, max_members=100)  # the server's own check
    assert info.files == 2
