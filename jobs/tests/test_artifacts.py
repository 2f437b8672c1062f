"""Recording a job's stored files (jobs.artifacts)."""
import hashlib

from jobs import artifacts


def test_digests_are_each_files_own_whether_hashed_one_by_one_or_together(tmp_path):
    small = [tmp_path / "a", tmp_path / "b"]
    big = [tmp_path / "c", tmp_path / "d", tmp_path / "e"]
    for i, path in enumerate(small + big):
        path.write_bytes(bytes([i]) * (10 if path in small else artifacts.PARALLEL_HASH_BYTES // 2))
    for paths in (small, big):  # below the threshold, and over it (threads)
        assert artifacts._digests(paths) == [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]
