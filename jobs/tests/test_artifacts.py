"""Recording a job's stored files (jobs.artifacts)."""
import hashlib

from django.db import connection
from django.test.utils import CaptureQueriesContext

from jobs import artifacts, storage
from tests.support.asgi import streamed
from tests.support.builders import job, member


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


def _output(target, results=0, checkpoints=0):
    """Write `results` result files, `checkpoints` checkpoint files and a log into the job's folder."""
    folder = storage.job_dir(target.tenant.slug, target.id)
    for sub, count in (("results", results), ("checkpoints/attempt-1", checkpoints), ("logs", 1)):
        (folder / sub).mkdir(parents=True, exist_ok=True)
        for i in range(count if sub != "logs" else 1):
            (folder / sub / (f"part-{i:03d}" if sub != "logs" else "training.log")).write_text(f"{sub} {i}\n")
    return folder


def test_it_records_at_most_the_cap_log_and_checkpoints_first_and_says_what_it_left(db, settings):
    settings.MAX_RECORDED_FILES = 5
    target = job(member())
    _output(target, results=10, checkpoints=2)
    notice = artifacts._record_artifacts(target)
    names = sorted(target.artifacts.values_list("name", flat=True))
    assert names == ["checkpoints/attempt-1/part-000", "checkpoints/attempt-1/part-001", "logs/training.log",
                     "results/part-000", "results/part-001"]
    assert notice == ("[trainyard] 8 files of this job's output were not recorded (5 were): at most 5 files are "
                      "recorded per job (TRAINYARD_MAX_RECORDED_FILES). They stay in the job's storage and result "
                      "stores, but are not listed or downloadable here.")


def test_recording_again_past_the_cap_keeps_the_rows_of_files_still_there(db, settings):
    target = job(member())
    folder = _output(target, results=6)
    assert artifacts._record_artifacts(target) is None
    settings.MAX_RECORDED_FILES = 3
    (folder / "results" / "part-005").unlink()
    assert "3 files" in artifacts._record_artifacts(target)  # 6 files left, 3 looked at
    # Rows of files not looked at this time stay; the one whose file is gone goes.
    assert sorted(target.artifacts.values_list("name", flat=True)) == [
        "logs/training.log", *[f"results/part-{i:03d}" for i in range(5)]]


def test_recording_stops_at_its_deadline(db, settings, monkeypatch):
    settings.RECORD_SECONDS = 10
    monkeypatch.setattr(artifacts, "RECORD_BATCH", 2)
    clock = iter(range(0, 10_000, 4))  # each look at the clock is 4 s later
    monkeypatch.setattr(artifacts.time, "monotonic", lambda: next(clock))
    target = job(member())
    _output(target, results=9)
    notice = artifacts._record_artifacts(target)
    assert target.artifacts.count() == 4  # two batches of two before the 10 s were up
    assert notice.startswith("[trainyard] 6 files of this job's output were not recorded (4 were): "
                             "recording stops after 10s (TRAINYARD_RECORD_SECONDS).")


def test_what_is_left_is_counted_until_the_deadline():
    assert artifacts._count_rest(iter(range(2000)), deadline=float("inf")) == (2000, True)
    assert artifacts._count_rest(iter(range(2000)), deadline=float("-inf")) == (artifacts.RECORD_BATCH, False)


def test_files_whose_names_no_artifact_may_have_are_left_unrecorded_and_named(db):
    target = job(member())
    results = storage.job_dir(target.tenant.slug, target.id) / "results"
    results.mkdir(parents=True)
    for name in ("good.txt", "bad\nname.txt", "evil\u202etxt.exe", "x" * 250 + "/" + "y" * 250):
        (results / name).parent.mkdir(parents=True, exist_ok=True)
        (results / name).write_text("x")
    (results / "latin1-\xe9".encode("latin-1").decode("utf-8", "surrogateescape")).write_text("x")
    refused = []
    assert artifacts._record_artifacts(target, refused) is None
    assert list(target.artifacts.values_list("name", flat=True)) == ["results/good.txt"]
    assert sorted(name for name, _ in refused) == sorted(["results/bad\nname.txt", "results/evil\u202etxt.exe",
                                                          "results/" + "x" * 250 + "/" + "y" * 250,
                                                          "results/latin1-\udce9"])
    assert "1 files" not in artifacts._refused_notice(refused)
    assert artifacts._refused_notice(refused[:1]).startswith(
        "[trainyard] 1 files of this job's output were not recorded because of their names ('results/")


def test_an_artifact_url_carries_its_name_unchanged(db):
    from jobs.serializers import ArtifactSerializer
    target = job(member())
    artifact = target.artifacts.create(name="results/a #1?.txt", kind="result", size=1)
    assert ArtifactSerializer(artifact).data["url"] == f"/api/v1/jobs/{target.id}/artifacts/results/a%20%231%3F.txt"


# --- downloads never follow a link ------------------------------------------------------------------
FLIPPER = """
import os, sys
target, victim = sys.argv[1], sys.argv[2]
link, plain = target + ".link", target + ".plain"
while True:
    try:
        os.unlink(link)
    except FileNotFoundError:
        pass
    os.symlink(victim, link)
    os.replace(link, target)  # a link to another tenant's file
    with open(plain, "w") as out:
        out.write("mine")
    os.replace(plain, target)  # a plain file again
"""


def recorded(membership, name, content="mine"):
    from jobs.models import Artifact
    target = job(membership)
    path = storage.create_job_dir(membership.tenant.slug, target.id) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    Artifact.objects.create(job=target, name=name, kind="result", size=len(content), sha256="0" * 64, attempt=1)
    return target, path


def another_tenants_secret():
    theirs = job(member("team-b", "bob"))
    secret = storage.create_job_dir("team-b", theirs.id) / "results" / "secret.txt"
    secret.write_text("TEAM-B SECRET")
    return secret


def download(client, target, name):
    answer = client.get(f"/api/v1/jobs/{target.id}/artifacts/{name}")
    return answer.status_code, streamed(answer) if answer.status_code == 200 else b""


def test_a_learner_swapping_a_link_in_for_its_result_never_gets_another_file_downloaded(db):
    """A later attempt's learner writes results/ while the earlier attempt's artifacts stay listed."""
    import subprocess
    import sys

    from tests.support.builders import client_for
    alice = member()
    target, path = recorded(alice, "results/model.bin")
    client = client_for(alice)
    flipper = subprocess.Popen([sys.executable, "-c", FLIPPER, str(path), str(another_tenants_secret())])
    try:
        answers = {download(client, target, "results/model.bin") for _ in range(600)}
    finally:
        flipper.kill()
        flipper.wait()
    assert answers <= {(200, b"mine"), (404, b"")}, answers
    assert (200, b"mine") in answers


def test_an_artifact_is_served_as_bytes_whatever_its_name(db):
    from tests.support.builders import client_for
    alice = member()
    target, _ = recorded(alice, "results/model.js", "alert(1)")
    answer = client_for(alice).get(f"/api/v1/jobs/{target.id}/artifacts/results/model.js")
    assert answer["Content-Type"] == "application/octet-stream"
    assert answer["Content-Disposition"] == 'attachment; filename="model.js"'
    assert answer["X-Content-Type-Options"] == "nosniff"


def test_a_linked_folder_a_fifo_or_a_dot_dot_is_no_artifact(db):
    import os

    from tests.support.builders import client_for
    alice = member()
    client = client_for(alice)
    secret = another_tenants_secret()
    target, path = recorded(alice, "results/sub/model.bin")
    os.rename(path.parent, path.parent.with_name("real"))
    os.symlink(secret.parent, path.parent)  # results/sub -> team-b's results
    (secret.parent / "model.bin").write_text("TEAM-B SECRET")
    assert download(client, target, "results/sub/model.bin") == (404, b"")
    fifo_job, fifo = recorded(alice, "results/pipe")
    fifo.unlink()
    os.mkfifo(fifo)
    assert download(client, fifo_job, "results/pipe") == (404, b"")
    assert storage.open_artifact(alice.tenant.slug, target.id, "results/../../x") is None
