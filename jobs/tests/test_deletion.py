"""Deleting a job (jobs.deletion, DELETE /api/v1/jobs/{id}/): who may, from which states, what it frees
at once, what its purge removes and what stays for accounting."""
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import deletion, states, storage, usage
from jobs.models import Artifact, Experiment, FollowUp, Job, LogLine, MetricPoint, Status, Trial
from tenants import quotas
from tenants.models import AuditEntry, UsageRecord
from tests.support.builders import client_for, job, member, record_sends

pytestmark = pytest.mark.django_db


@pytest.fixture
def sent(monkeypatch):
    return record_sends(monkeypatch)


@pytest.fixture
def alice():
    return member("team-a", "alice")


def stored_job(owner, status=Status.COMPLETED):
    """An ended job with what a run leaves: a folder with files, log lines, metric points, artifacts, usage."""
    target = job(owner, status=status, code_bytes=1000)
    folder = storage.create_job_dir(owner.tenant.slug, target.id)
    (folder / "results").mkdir(exist_ok=True)
    (folder / "results" / "model.bin").write_bytes(b"w" * 500)
    Artifact.objects.create(job=target, name="results/model.bin", kind="result", size=500, sha256="0" * 64)
    LogLine.objects.bulk_create(LogLine(job=target, seq=i, learner=0, stream="stdout", time=timezone.now(),
                                        line=f"line {i}") for i in range(1, 6))
    MetricPoint.objects.create(job=target, name="loss", step=1, value=0.5, time=timezone.now(), learner=0)
    now = timezone.now()
    UsageRecord.objects.create(tenant=owner.tenant, job=target, user=owner.user, attempt=1, gpus=2, cpus=1,
                               memory_bytes=2**30, started_at=now - timedelta(hours=1), ended_at=now)
    return target


def purged(target):
    return Job.objects.get(pk=target.id).purged_at is not None


def test_the_owner_deletes_an_ended_job_and_nobody_sees_it_again(alice, sent):
    target = stored_job(alice)
    client = client_for(alice)
    response = client.delete(f"/api/v1/jobs/{target.id}/")
    assert response.status_code == 202, response.json()
    assert response.json()["id"] == target.id
    assert client.get(f"/api/v1/jobs/{target.id}/").status_code == 404
    assert client.get(f"/api/v1/jobs/{target.id}/logs/").status_code == 404
    assert target.id not in [row["id"] for row in client.get("/api/v1/jobs/").json()["results"]]
    assert client.delete(f"/api/v1/jobs/{target.id}/").status_code == 404
    row = Job.objects.get(pk=target.id)
    assert row.deleted_at is not None and row.deleted_by == "alice" and row.status == Status.COMPLETED
    assert not purged(target)
    entry = AuditEntry.objects.get(target_type="job", target=target.id)
    assert (entry.action, entry.actor, entry.tenant) == ("deleted", "alice", alice.tenant)
    assert entry.before == {"name": target.name, "owner": "alice", "status": "COMPLETED"}


@pytest.mark.parametrize("status", ["QUEUED", "PENDING", "PROCESSING", "STORING", "HALTING"])
def test_a_job_that_has_not_ended_is_refused_with_409_naming_its_status(alice, sent, status):
    target = job(alice, status=status)
    response = client_for(alice).delete(f"/api/v1/jobs/{target.id}/")
    assert response.status_code == 409
    assert status in response.json()["detail"] and "terminate it first" in response.json()["detail"]
    assert Job.objects.get(pk=target.id).deleted_at is None


@pytest.mark.parametrize("status", ["COMPLETED", "FAILED", "TERMINATED", "HALTED"])
def test_ended_and_halted_jobs_can_be_deleted(alice, sent, status):
    target = job(alice, status=status)
    assert client_for(alice).delete(f"/api/v1/jobs/{target.id}/").status_code == 202


def test_only_the_owner_and_tenant_admins_delete_a_job(alice, sent):
    from guardian.shortcuts import assign_perm
    target = job(alice, status=Status.COMPLETED)
    viewer, colleague = member("team-a", "vic", role="viewer"), member("team-a", "bob")
    assign_perm("jobs.change_job", colleague.user, target)  # shared for control: halt, resume, terminate
    for other in (viewer, colleague):
        response = client_for(other).delete(f"/api/v1/jobs/{target.id}/")
        assert response.status_code == 403 and "owner and tenant admins" in response.json()["detail"]
    assert client_for(member("team-b", "mallory", role="admin")).delete(f"/api/v1/jobs/{target.id}/").status_code == 404
    assert Job.objects.get(pk=target.id).deleted_at is None
    assert client_for(member("team-a", "ada", role="admin")).delete(f"/api/v1/jobs/{target.id}/").status_code == 202


def test_an_experiments_trial_is_kept_with_its_experiment(alice, sent):
    experiment = Experiment.objects.create(tenant=alice.tenant, owner=alice.user, name="e", spec={}, manifest_yaml="",
                                           searcher="random", metric="acc", code_sha256="0" * 64)
    target = job(alice, status=Status.TERMINATED)
    Trial.objects.create(experiment=experiment, number=3, job=target, params={"lr": 0.1})
    response = client_for(alice).delete(f"/api/v1/jobs/{target.id}/")
    assert response.status_code == 409
    assert response.json()["detail"] == (f"job {target.id} is trial 3 of experiment {experiment.id}: "
                                         "it goes when its experiment is deleted")


def test_a_deleted_halted_job_never_moves_again(alice, sent):
    """Resume and delete racing: once the delete has won, the resume's compare-and-swap finds no job."""
    target = job(alice, status=Status.HALTED)
    assert client_for(alice).delete(f"/api/v1/jobs/{target.id}/").status_code == 202
    assert states.transition(target.id, Status.QUEUED, actor="alice", attempt_next=True) is None
    assert states.transition(target.id, Status.TERMINATED, actor="alice") is None
    assert Job.objects.get(pk=target.id).status == Status.HALTED


def test_its_storage_stops_counting_against_the_quota_once_purged(alice, sent):
    target = stored_job(alice)
    job(alice, status=Status.COMPLETED, code_bytes=300)
    assert quotas.stored_bytes(alice.tenant) == 1000 + 500 + 300
    client_for(alice).delete(f"/api/v1/jobs/{target.id}/")
    assert quotas.stored_bytes(alice.tenant) == 1000 + 500 + 300  # its files still take the disk
    deletion.purge_pass()
    assert quotas.stored_bytes(alice.tenant) == 300


def test_the_purge_removes_its_files_logs_and_metrics_and_keeps_its_usage_and_history(alice, sent):
    target = stored_job(alice)
    folder = storage.job_dir("team-a", target.id)
    kept = stored_job(alice)
    client_for(alice).delete(f"/api/v1/jobs/{target.id}/")
    assert deletion.purge_pass() == 1 and purged(target)
    assert deletion.purge_pass() == 0
    assert not folder.exists() and storage.job_dir("team-a", kept.id).exists()
    assert LogLine.objects.filter(job_id=kept.id).count() == 5
    for model in (LogLine, MetricPoint, Artifact):
        assert not model.objects.filter(job_id=target.id).exists()
    assert UsageRecord.objects.filter(job_id=target.id).count() == 1
    assert Job.objects.filter(pk=target.id).exists()
    start = timezone.now() - timedelta(days=1)
    report = usage.report(alice.tenant, start=start, end=timezone.now() + timedelta(minutes=1))
    assert report["tenant"]["allocated_gpu_hours"] == pytest.approx(4.0, abs=0.01)  # both jobs' GPU-hours count


def test_the_purge_waits_for_the_jobs_teardown(alice, sent):
    """A teardown still open may be stopping what ran in the folder: the purge goes after it."""
    target = stored_job(alice, status=Status.TERMINATED)
    teardown = FollowUp.objects.create(job=target, attempt=1, kind=FollowUp.Kind.TEARDOWN)
    client_for(alice).delete(f"/api/v1/jobs/{target.id}/")
    assert deletion.purge_pass() == 0
    assert storage.job_dir("team-a", target.id).exists() and not purged(target)
    FollowUp.objects.filter(pk=teardown.pk).update(done_at=timezone.now())
    assert deletion.purge_pass() == 1
    assert not storage.job_dir("team-a", target.id).exists()


def test_a_tenant_deleting_many_jobs_does_not_hold_up_anothers_purge(sent, monkeypatch):
    """Each round of a pass takes a few jobs of every tenant, and a pass stops at its budget."""
    many, one = member("team-a", "alice"), member("team-b", "bob")
    monkeypatch.setattr(deletion, "PER_TENANT", 2)
    busy = [job(many, status=Status.COMPLETED) for _ in range(6)]
    other = job(one, status=Status.COMPLETED)
    for membership, target in [(many, j) for j in busy] + [(one, other)]:
        client_for(membership).delete(f"/api/v1/jobs/{target.id}/")
    assert deletion.purge_pass(budget_s=0) == 0  # the budget is spent before the first
    order = []
    monkeypatch.setattr(deletion.storage, "remove_job_dir", lambda slug, job_id: order.append(slug) or True)
    assert deletion.purge_pass() == 7
    assert order[:3].count("team-b") == 1  # in the first round, beside team-a's first two
    assert all(purged(target) for target in busy + [other])


def test_a_purge_that_fails_is_tried_again_by_the_next_pass(alice, sent, monkeypatch):
    target = stored_job(alice)
    client_for(alice).delete(f"/api/v1/jobs/{target.id}/")
    monkeypatch.setattr(deletion.storage, "remove_job_dir", lambda slug, job_id: False)
    assert deletion.purge_pass() == 0
    assert not purged(target) and storage.job_dir("team-a", target.id).exists()
    monkeypatch.undo()
    assert deletion.purge_pass() == 1 and purged(target)
    assert not storage.job_dir("team-a", target.id).exists()


# --- experiments ---------------------------------------------------------------------------------------
def experiment_of(owner, *, trial_statuses=(Status.COMPLETED, Status.HALTED), finished=True, state="COMPLETED"):
    """An experiment with its folder (its code archive) and a trial job in each of `trial_statuses`."""
    experiment = Experiment.objects.create(
        tenant=owner.tenant, owner=owner.user, name="sweep", manifest_yaml="", searcher="random",
        spec={"searcher": {"name": "random", "metric": "acc", "max_trials": 2, "max_concurrent_trials": 1},
              "hyperparameters": []},
        metric="acc", code_sha256="0" * 64, code_bytes=700, state=state,
        finished_at=timezone.now() if finished else None)
    folder = storage.stage_dir(owner.tenant.slug, experiment.id)
    (folder / "code.tar.gz").write_bytes(b"c" * 700)
    storage.unstage(owner.tenant.slug, experiment.id)
    for number, status in enumerate(trial_statuses):
        Trial.objects.create(experiment=experiment, number=number, job=job(owner, status=status, code_bytes=700),
                             params={"lr": 0.1})
    return experiment


def test_a_finished_experiment_is_deleted_with_its_trials(alice, sent, django_capture_on_commit_callbacks):
    experiment = experiment_of(alice)
    trials = list(Job.objects.filter(trial__experiment=experiment))
    client = client_for(alice)
    assert quotas.stored_bytes(alice.tenant) == 700  # the trials' code is the experiment's, counted once
    with django_capture_on_commit_callbacks(execute=True):
        response = client.delete(f"/api/v1/experiments/{experiment.id}/")
    assert response.status_code == 202, response.json()
    assert client.get(f"/api/v1/experiments/{experiment.id}/").status_code == 404
    assert client.get("/api/v1/experiments/").json()["results"] == []
    for trial_job in trials:
        assert client.get(f"/api/v1/jobs/{trial_job.id}/").status_code == 404
        assert Job.objects.get(pk=trial_job.id).deleted_at is not None
    assert not storage.job_dir("team-a", experiment.id).exists()
    assert quotas.stored_bytes(alice.tenant) == 0
    entry = AuditEntry.objects.get(target_type="experiment", target=experiment.id)
    assert entry.before["trials"] == 2 and entry.actor == "alice"


@pytest.mark.parametrize("state, finished, why", [
    ("ACTIVE", False, "is ACTIVE; only a finished experiment can be deleted (kill it first)"),
    ("TERMINATED", False, "is TERMINATED and its trials are still stopping"),
])
def test_an_experiment_that_has_not_finished_is_refused(alice, sent, state, finished, why):
    experiment = experiment_of(alice, finished=finished, state=state)
    response = client_for(alice).delete(f"/api/v1/experiments/{experiment.id}/")
    assert response.status_code == 409 and why in response.json()["detail"]
    folder = storage.job_dir("team-a", experiment.id)
    assert (folder / "code.tar.gz").exists() and not (folder / storage.STAGED_MARK).exists()
    assert not Job.objects.exclude(deleted_at=None).exists()


def test_an_experiment_with_a_trial_still_stopping_deletes_nothing(alice, sent):
    experiment = experiment_of(alice, trial_statuses=(Status.COMPLETED, Status.STORING))
    response = client_for(alice).delete(f"/api/v1/experiments/{experiment.id}/")
    assert response.status_code == 409 and "trials still stopping" in response.json()["detail"]
    assert not Job.objects.exclude(deleted_at=None).exists()
    assert Experiment.objects.get(pk=experiment.id).deleted_at is None
    assert not (storage.job_dir("team-a", experiment.id) / storage.STAGED_MARK).exists()


def test_only_the_experiments_owner_and_tenant_admins_delete_it(alice, sent):
    experiment = experiment_of(alice)
    for other in (member("team-a", "vic", role="viewer"), member("team-a", "bob")):
        assert client_for(other).delete(f"/api/v1/experiments/{experiment.id}/").status_code == 403
    assert Experiment.objects.get(pk=experiment.id).deleted_at is None


def test_the_sweep_finishes_what_a_killed_deletion_left_of_an_experiments_folder(alice, sent):
    """Killed after the deletion committed, before its folder went: the sweep removes the staged folder of
    a deleted experiment. Killed before it committed: the sweep gives the folder back to its experiment."""
    import os
    import time

    from jobs import reconcile
    deleted, kept = experiment_of(alice), experiment_of(alice)
    then = time.time() - reconcile.ORPHAN_GRACE_S - 60
    for experiment in (deleted, kept):
        folder = storage.stage_dir("team-a", experiment.id)
        os.utime(folder / storage.STAGED_MARK, (then, then))
    Experiment.objects.filter(pk=deleted.pk).update(deleted_at=timezone.now(), deleted_by="alice")
    reconcile.sweep_storage()
    assert not storage.job_dir("team-a", deleted.id).exists()
    folder = storage.job_dir("team-a", kept.id)
    assert (folder / "code.tar.gz").exists() and not (folder / storage.STAGED_MARK).exists()


# --- what an attacker or a noisy neighbour brings: a purge that keeps failing, deletions racing ---------

def deleted(membership, target):
    assert client_for(membership).delete(f"/api/v1/jobs/{target.id}/").status_code == 202
    return target


def test_it_purges_every_other_job_when_one_purge_keeps_failing(sent, monkeypatch):
    """A folder the worker cannot remove (a learner left a directory it may not write in) fails its own
    purge, every pass: the jobs after it, the same tenant's and the others', are purged all the same."""
    alice, bob = member("team-a", "alice"), member("team-b", "bob")
    stuck = deleted(alice, stored_job(alice))  # the oldest deletion: first in its tenant's round
    after = deleted(alice, stored_job(alice))
    other = deleted(bob, stored_job(bob))
    remove = storage.remove_job_dir
    monkeypatch.setattr(deletion.storage, "remove_job_dir",
                        lambda slug, job_id: False if job_id == stuck.id else remove(slug, job_id))
    assert deletion.purge_pass() == 2
    assert purged(after) and purged(other) and not purged(stuck)


def test_it_tries_a_failing_purge_once_a_pass(sent, monkeypatch):
    """Within a pass a purge that failed is not taken again, round after round, until the budget is spent."""
    alice = member("team-a", "alice")
    stuck = deleted(alice, stored_job(alice))
    tries = []
    monkeypatch.setattr(deletion.storage, "remove_job_dir", lambda slug, job_id: tries.append(job_id) and False)
    assert deletion.purge_pass(budget_s=0.5) == 0
    assert tries == [stuck.id] and not purged(stuck)


def test_it_answers_404_to_a_job_deleted_meanwhile(sent):
    """Two deletions racing: the one that loses found the job before the other committed. The job is
    gone, so 404 as for any later request, not a 409 saying it has not ended."""
    alice = member("team-a", "alice")
    target = stored_job(alice)
    stale = Job.objects.get(pk=target.id)
    deleted(alice, target)
    with pytest.raises(deletion.AlreadyDeleted, match=f"job {target.id} is deleted"):
        deletion.delete(stale, actor="alice")


def test_it_leaves_no_folder_of_an_experiment_deleted_meanwhile(sent, django_capture_on_commit_callbacks):
    """The deletion that loses the race staged (so made again) the folder the winner removed: it goes."""
    alice = member("team-a", "alice")
    experiment = experiment_of(alice, trial_statuses=(Status.COMPLETED,))
    stale = Experiment.objects.get(pk=experiment.id)
    with django_capture_on_commit_callbacks(execute=True):
        assert client_for(alice).delete(f"/api/v1/experiments/{experiment.id}/").status_code == 202
    with pytest.raises(deletion.AlreadyDeleted, match=f"experiment {experiment.id} is deleted"):
        deletion.delete_experiment(stale, actor="alice")
    assert not storage.job_dir("team-a", experiment.id).exists()


@pytest.mark.parametrize("path", ["jobs", "experiments"])
def test_a_deletion_that_loses_the_race_is_answered_404(sent, monkeypatch, path):
    alice = member("team-a", "alice")
    target = stored_job(alice) if path == "jobs" else experiment_of(alice)
    name = "delete" if path == "jobs" else "delete_experiment"

    def deleted_meanwhile(row, *, actor):
        raise deletion.AlreadyDeleted(f"{row.id} is deleted")
    monkeypatch.setattr(deletion, name, deleted_meanwhile)
    response = client_for(alice).delete(f"/api/v1/{path}/{target.id}/")
    assert response.status_code == 404
