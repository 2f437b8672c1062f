"""Pushing a job's output to its result stores (jobs.transfers) when the learner left it hostile."""
import os

import pytest

from jobs import datastores, runtime, storage, transfers
from jobs.models import LogLine
from tests.support.builders import job, member
from trainyard.manifest import parse_manifest

pytestmark = pytest.mark.django_db
MiB = 2**20
LOCAL_RESULTS = """
name: local-results
framework: {name: custom, command: sh run.sh}
data_stores:
  - id: shelf
    type: local
    training_results: {container: trained}
"""


def job_with_local_results(membership, **caps):
    manifest = parse_manifest(LOCAL_RESULTS)
    target = job(membership, manifest_yaml=LOCAL_RESULTS, runtime=runtime.from_manifest(manifest, disk_caps=caps))
    folder = storage.job_dir(membership.tenant.slug, target.id)
    for name in ("results", "checkpoints"):
        (folder / name).mkdir(parents=True)
    return target, folder


def pushed_bytes(settings, membership):
    store = datastores.local_root(settings.DATA_DIR, membership.tenant.slug)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(store) for f in files)


def test_it_pushes_nothing_past_the_caps_of_a_sparse_or_hard_linked_output(settings):
    # A learner makes a file of any length in an instant (a hole: one truncate) or the same file
    # under many names, between two measurements of its agent's watch; the push writes every name
    # whole, holes as zeros, into the tenant's folder on the platform's own disk.
    alice = member()
    target, folder = job_with_local_results(alice, results=MiB, checkpoints=MiB)
    with open(folder / "results" / "sparse.bin", "wb") as f:
        f.truncate(64 * MiB)
    failure = transfers.push_results(target, runtime.of(target))
    assert failure is not None and "results folder" in failure and "cap" in failure
    assert pushed_bytes(settings, alice) == 0

    (folder / "results" / "sparse.bin").unlink()
    (folder / "checkpoints" / "attempt-1").mkdir()
    (folder / "checkpoints" / "attempt-1" / "ckpt").write_bytes(b"\1" * (MiB // 2))
    for i in range(16):
        os.link(folder / "checkpoints" / "attempt-1" / "ckpt", folder / "checkpoints" / "attempt-1" / f"again-{i}")
    failure = transfers.push_results(target, runtime.of(target))
    assert failure is not None and "checkpoints folder" in failure
    assert pushed_bytes(settings, alice) == 0
    assert LogLine.objects.filter(job=target, stream="system", line__contains="checkpoints folder").exists()


def test_output_within_its_caps_is_pushed(settings):
    alice = member()
    target, folder = job_with_local_results(alice, results=MiB, checkpoints=MiB)
    (folder / "results" / "model.txt").write_bytes(b"m" * 1000)
    assert transfers.push_results(target, runtime.of(target)) is None
    assert pushed_bytes(settings, alice) == 1000


def test_links_in_the_output_are_left_out_and_named_in_the_jobs_log(settings, tmp_path):
    alice = member()
    target, folder = job_with_local_results(alice, results=MiB, checkpoints=MiB)
    (tmp_path / "secret").write_bytes(b"s" * 100)
    (folder / "results" / "model.txt").write_bytes(b"m" * 1000)
    (folder / "results" / "latest").symlink_to("model.txt")
    (folder / "results" / "key").symlink_to(tmp_path / "secret")
    (folder / "checkpoints" / "elsewhere").symlink_to(tmp_path)
    assert transfers.push_results(target, runtime.of(target)) is None
    assert pushed_bytes(settings, alice) == 1000
    line = LogLine.objects.get(job=target, stream="system", line__contains="left out").line
    assert line == ("[trainyard] uploading to data store 'shelf' (folder trained): 3 symbolic links or other entries "
                    "that are not plain files were left out (a link is never followed): 'results/key', "
                    "'results/latest', 'checkpoints/elsewhere'")
