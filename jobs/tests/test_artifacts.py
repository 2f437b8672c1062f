"""Recording a job's stored files (jobs.artifacts)."""
import hashlib

from django.db import connection
from django.test.utils import CaptureQueriesContext

from jobs import artifacts, storage
from jobs.tests.builders import job, member


def test_digests_are_each_files_own_whether_hashed_one_by_one_or_together(tmp_path):
    small = [tmp_path / "a", tmp_path / "b"]
    big = [tmp_path / "c", tmp_path / "d", tmp_path / "e"]
    for i, path in enumerate(small + big):
        path.write_bytes(bytes([i]) * (10 if path in small else artifacts.PARALLEL_HASH_BYTES // 2))
    for paths in (small, big):  # below the threshold, and over it (threads)
        assert artifacts._digests(paths) == [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]


def _recording_queries(target, files):
    """The queries of recording `target`'s files a second time (the first recorded them), with
    `files` result files in its folder."""
    results = storage.job_dir(target.tenant.slug, target.id) / "results"
    results.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (results / f"part-{i}.txt").write_text(f"result {i}\n")
    artifacts._record_artifacts(target)
    with CaptureQueriesContext(connection) as queries:
        artifacts._record_artifacts(target)
    return len(queries)


def test_recording_a_jobs_files_again_takes_the_same_queries_however_many_are_recorded(db):
    # Read through the job's reverse relation with only(), each recorded artifact cost one more
    # query for the job Django sets on it from its deferred job_id.
    alice = member()
    few, many = job(alice), job(alice)
    assert _recording_queries(few, 2) == _recording_queries(many, 12) == 1
