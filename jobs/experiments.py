"""Experiments: hyperparameter searches whose trials are ordinary jobs of the tenant.

An experiment is created with its manifest (trainyard.experiment) and one code archive; from then on
the scheduling loop drives it (`advance_all`, run before each admission cycle, so the trials it starts
are admitted by that same cycle). Each pass over one experiment happens in one transaction under the
experiment's row lock:

1. observe: each trial's job and the searcher's metric points that arrived since the last pass (the
   experiment's `points_seen` cursor) bring the trial's latest value, its ASHA rungs, and its end;
2. ASHA: a trial that reached the rung it was allowed to is let go on or paused (its job halted through
   its checkpoint, its GPUs freed by that halt);
3. fill: while fewer than max_concurrent_trials run, a paused trial now good enough is promoted
   (resumed from its checkpoint as its next attempt), or a new configuration is asked of the searcher
   (gpu_scheduler.search, Optuna) and started as a new job;
4. end: when nothing runs and nothing is left to try, paused trials are stopped and the experiment
   completes.

The searcher's whole state is these rows: a process killed mid-pass rolls the pass back, and the next
pass (of the standby taking over, or of the restarted loop) decides again from what was committed. A
trial's number is the experiment's `trials_started`, bumped in the transaction that stores its job, so
no trial is started twice or lost.

Trials are jobs like any other: they queue against the tenant's quota and fair share, at the manifest's
priority, may borrow and be preempted, and can be halted, resumed and terminated one by one.
"""
import json
import logging
import math
import shutil
from pathlib import Path

import yaml
from django.db import transaction
from django.db.models import Q
from django.http import Http404
from django.utils import timezone

from gpu_scheduler import search as searching
from jobs import datastores, dispatch, lifecycle, storage, submission, transfers
from jobs.models import ACTIVE, FINAL, Experiment, MetricPoint, Status, Trial
from jobs.states import InvalidTransition
from tenants import access, quotas
from tenants.models import Membership
from trainyard import experiment as experiments
from trainyard.manifest import ManifestError, parse_fields

log = logging.getLogger(__name__)
HPARAMS_FILE = "hparams.json"  # in each trial's results: the hyperparameters it ran with
# New trials one pass may start: an experiment reaches its max_concurrent_trials over a few cycles, and
# no tenant's search holds the scheduling loop, which admits every tenant's jobs, for long.
NEW_TRIALS_PER_PASS = 4


class ExperimentError(submission.SubmitError):
    """A request about an experiment that cannot be done (bad manifest, wrong state)."""


# --- create -------------------------------------------------------------------------------------
def create(membership, *, manifest_bytes, code_file, private=False, admitted=None):
    """Validate and store a new experiment; its trials start from the scheduling loop's next pass.
    `admitted`: what submission.admit() answered, when the caller has called it already."""
    admitted = admitted or submission.admit(membership)
    try:
        spec = experiments.parse_experiment(manifest_bytes)
    except ManifestError as exc:
        raise ExperimentError(str(exc), field=exc.field) from None
    submission.disk_caps_for(membership.tenant, spec.manifest, admitted.quota)
    submission.check_priority(membership, spec.manifest)
    upload, info = submission.checked_code(code_file)
    stored = spec.to_json()
    stored["fields"] = datastores.redact(stored["fields"])
    experiment = Experiment(
        tenant=membership.tenant, owner=membership.user, name=spec.name, description=spec.manifest.description,
        spec=stored, manifest_yaml=datastores.redact_yaml(manifest_bytes.decode("utf-8")),
        searcher=spec.searcher.name, metric=spec.searcher.metric, smaller_is_better=spec.searcher.smaller_is_better,
        private=private, code_sha256=storage.sha256_of(upload), code_bytes=upload.stat().st_size)
    folder = storage.job_dir(membership.tenant.slug, experiment.id)
    try:
        folder.mkdir(parents=True)
        shutil.copyfile(upload, folder / f"code.{info.kind}")
        transfers.seal_submitted_credentials(folder, spec.manifest)
        with transaction.atomic():
            experiment.save(force_insert=True)
            dispatch.wake_scheduler_on_commit()
    except Exception:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        upload.unlink(missing_ok=True)
    return experiment


# --- user actions -------------------------------------------------------------------------------
def pause(experiment, *, actor):
    """No trial starts; running ones are halted through their checkpoints (a queued one as soon as it
    is admitted) and resume with the experiment."""
    return _set_state(experiment, Experiment.State.PAUSED, {Experiment.State.ACTIVE}, f"paused by {actor}")


def resume(experiment, *, actor):
    return _set_state(experiment, Experiment.State.ACTIVE, {Experiment.State.PAUSED}, f"resumed by {actor}")


def kill(experiment, *, actor):
    """Stop for good: every trial's job is terminated by the next pass."""
    return _set_state(experiment, Experiment.State.TERMINATED, {Experiment.State.ACTIVE, Experiment.State.PAUSED},
                      f"killed by {actor}")


def _set_state(experiment, target, sources, reason):
    with transaction.atomic():
        row = Experiment.objects.select_for_update().get(pk=experiment.pk)
        if row.state not in sources:
            raise ExperimentError(f"experiment {row.id} is {row.state}; only an experiment that is "
                                  f"{' or '.join(sorted(sources))} can be {reason.split()[0]}", status=409)
        row.state, row.state_reason, row.updated_at = target, reason, timezone.now()
        row.save(update_fields=["state", "state_reason", "updated_at"])
        dispatch.wake_scheduler_on_commit()
    if target == Experiment.State.TERMINATED:
        advance(row.pk)  # its trials stop now, not at the loop's next pass
        row.refresh_from_db()
    return row


# --- the loop's pass ----------------------------------------------------------------------------
def advance_all():
    """One pass over every experiment not yet ended (the scheduling loop calls this each cycle). A killed
    one counts until its pass has stopped its trials: the kill commits first, and a web process that
    dies before its own pass leaves that pass to this loop."""
    for experiment_id in Experiment.objects.filter(finished_at=None).values_list("id", flat=True):
        try:
            advance(experiment_id)
        except Exception:
            log.exception("experiment %s: its pass failed; the next one tries again", experiment_id)


def advance(experiment_id):
    with transaction.atomic():
        experiment = (Experiment.objects.select_for_update().select_related("tenant", "owner")
                      .filter(pk=experiment_id).first())
        if experiment is None or experiment.finished_at is not None:
            return
        Pass(experiment).run()


class Pass:
    """One pass over one locked experiment (module docstring)."""

    def __init__(self, experiment):
        self.experiment = experiment
        self.spec = experiments.from_json(experiment.spec)
        self.search = searching.Search(self.spec)
        self.trials = list(experiment.trials.select_related("job").order_by("number"))
        self.actor = f"experiment {experiment.id}"
        self.asha = self.spec.searcher.name == "asha"

    def run(self):
        state, before = self.experiment.state, self.recorded()
        self.observe()
        if state == Experiment.State.ACTIVE and (why := self.owner_may_not_submit()):
            state = self.experiment.state = Experiment.State.PAUSED  # its running trials halt below
            self.experiment.state_reason = why
        if state == Experiment.State.TERMINATED:
            self.stop_all()
        elif state == Experiment.State.PAUSED:
            self.hold_running()
        else:
            self.resume_held()
            self.fill()
            self.end_if_done()
        self.record_best()
        for trial in self.trials:
            if trial.tracker.changed:
                trial.updated_at = timezone.now()
                trial.save()
        if self.recorded() != before:  # most passes over a running experiment change nothing
            self.experiment.updated_at = timezone.now()
            self.experiment.save()

    def owner_may_not_submit(self):
        """Why the experiment's owner may not start its trials now ("" when they may): trials are jobs
        they submit, so an owner who left the tenant, or is a viewer now, starts none."""
        experiment = self.experiment
        try:  # as a request of theirs would act in the tenant (a platform admin: as its admin)
            membership = access.membership_for(experiment.owner, experiment.tenant.slug)
        except access.NoTenant:
            return f"paused: its owner {experiment.owner.username} is no longer a member of {experiment.tenant.slug}"
        if not membership.can_submit:
            return f"paused: its owner {experiment.owner.username} is a {membership.role} and may not submit jobs"
        return ""

    def recorded(self):
        """What a pass may change of the experiment's row."""
        row = self.experiment
        return (row.state, row.state_reason, row.trials_started, row.best_trial, row.best_value, row.points_seen,
                row.finished_at, row.spec.get("exhausted"))

    # --- 1. observe -------------------------------------------------------------------------------
    def observe(self):
        for trial in self.trials:
            trial.tracker = _Tracker()
        open_trials = {t.job_id: t for t in self.trials if t.state in (Trial.State.RUNNING, Trial.State.PAUSED)}
        if open_trials:
            points = (MetricPoint.objects.filter(job_id__in=list(open_trials), name=self.spec.searcher.metric,
                                                 id__gt=self.experiment.points_seen)
                      .order_by("id").values_list("id", "job_id", "step", "value"))
            for point_id, job_id, step, value in points:
                self.experiment.points_seen = max(self.experiment.points_seen, point_id)
                if value is not None and math.isfinite(value):
                    trial = open_trials[job_id]
                    trial.value, trial.step = value, step
                    trial.tracker.changed = True
                    trial.tracker.points.append((step, value))
        if self.asha:
            self.rungs_reached()
        for trial in open_trials.values():
            self.see_job(trial)

    def rungs_reached(self):
        """Record the rung each running trial reached with this pass's points, all first, then decide for
        each (so trials that got there together compete together); one let go on may have reached the
        next rung already."""
        waiting = [t for t in self.trials if t.state == Trial.State.RUNNING and self.record_next_rung(t)]
        for trial in waiting:
            while True:
                rung = trial.promoted + 1
                if self.search.goes_on(self.views(), trial.number, rung):
                    trial.promoted = rung
                    if self.record_next_rung(trial):
                        continue
                    break
                trial.state = Trial.State.PAUSED
                if self.would_promote_last(trial):
                    trial.state, trial.promoted = Trial.State.RUNNING, rung
                    break
                self.halt(trial, f"paused at rung {rung + 1} ({self.spec.searcher.metric} "
                                 f"{trial.rungs[str(rung)]:.4g} at step {self.spec.searcher.rungs()[rung]}): not "
                                 f"among the best 1/{self.spec.searcher.divisor} there")
                break

    def would_promote_last(self, trial):
        """Whether the trial, paused, would be promoted at once as the experiment's last (end_if_done):
        then it goes on instead of being halted and resumed."""
        if any(t.state == Trial.State.RUNNING for t in self.trials) or not self.out_of_trials():
            return False
        return self.search.promotions(self.views(), finishing=True)[:1] == [(trial.number, trial.promoted + 1)]

    def record_next_rung(self, trial):
        """Record the value at the rung the trial may reach next (the one after the last it was let go
        on from) if this pass's points got it there; whether they did."""
        rung = trial.promoted + 1
        if rung >= len(self.spec.searcher.rungs()) - 1 or str(rung) in trial.rungs:
            return False
        value = self.search.rung_reached(trial.tracker.points, rung)
        if value is None:
            return False
        trial.rungs[str(rung)] = value
        return True

    def see_job(self, trial):
        status = trial.job.status
        if status == Status.COMPLETED and trial.state != Trial.State.COMPLETED:
            self.settle_value(trial)
            trial.state = Trial.State.COMPLETED
            if self.asha and trial.value is not None:
                trial.rungs[str(len(self.spec.searcher.rungs()) - 1)] = trial.value
        elif status == Status.FAILED:
            trial.state = Trial.State.FAILED
        elif status == Status.TERMINATED:
            trial.state = Trial.State.STOPPED
        else:
            return
        trial.tracker.changed = True

    def settle_value(self, trial):
        """The metric's last value, read again at the end (a point may have committed after a later one's id)."""
        last = (MetricPoint.objects.filter(job_id=trial.job_id, name=self.spec.searcher.metric)
                .order_by("-id").values_list("step", "value").first())
        if last is not None and last[1] is not None and math.isfinite(last[1]):
            trial.step, trial.value = last

    # --- 2/3. fill ----------------------------------------------------------------------------------
    def fill(self):
        searcher = self.spec.searcher
        room = searcher.max_concurrent_trials - sum(t.state == Trial.State.RUNNING for t in self.trials)
        queue_room, new_trials = None, 0
        while room > 0 and new_trials < NEW_TRIALS_PER_PASS:
            promotion = self.search.promotions(self.views()) if self.asha else []
            if promotion:
                self.promote(*promotion[0])
                room -= 1
                continue
            if queue_room is None:
                queue_room = submission.queue_room(self.experiment.tenant)
            if queue_room <= 0:
                self.experiment.state_reason = "waiting: the tenant has as many jobs queued as it may"
                return
            if self.out_of_trials():
                return
            proposal = self.search.propose(self.views(), self.experiment.trials_started)
            if proposal is None:
                self.experiment.state_reason = "the search space is exhausted"
                self.experiment.spec = {**self.experiment.spec, "exhausted": True}
                return
            self.start_trial(proposal)
            room -= 1
            queue_room -= 1
            new_trials += 1

    def out_of_trials(self):
        searcher = self.spec.searcher
        if self.experiment.spec.get("exhausted") or self.experiment.trials_started >= searcher.max_trials:
            return True
        if searcher.max_gpu_hours is not None and self.gpu_hours() >= searcher.max_gpu_hours:
            self.experiment.state_reason = f"its budget of {searcher.max_gpu_hours} GPU-hours is spent"
            return True
        return False

    def gpu_hours(self):
        usage = quotas.records_usage(quotas.UsageRecord.objects.filter(job__trial__experiment=self.experiment))
        return usage["gpu_hours"]

    def start_trial(self, proposal):
        number = self.experiment.trials_started
        values = {**self.spec.constants(), **proposal.params}
        fields = experiments.trial_fields(self.spec, proposal.params, number)
        manifest = parse_fields(json.loads(json.dumps(fields)))
        tenant, folder = self.experiment.tenant, storage.job_dir(self.experiment.tenant.slug, self.experiment.id)
        code = next(iter(sorted(folder.glob("code.*"))))
        job = submission.store_job(
            tenant, self.experiment.owner, manifest, yaml.safe_dump(fields, sort_keys=False), code,
            code.name.removeprefix("code."), private=self.experiment.private,
            disk_caps=submission.disk_caps_for(tenant, manifest, quotas.quota_of(tenant)),
            credentials=transfers.sealed_credentials(folder),
            runtime_extra={"hyperparameters": values, "experiment": {"id": self.experiment.id, "trial": number}})
        _write_hparams(job, values)
        trial = Trial.objects.create(experiment=self.experiment, number=number, job=job, params=values,
                                     system_attrs=proposal.system_attrs)
        trial.tracker = _Tracker()
        self.trials.append(trial)
        self.experiment.trials_started = number + 1
        self.experiment.state_reason = ""

    def promote(self, number, rung):
        trial = next(t for t in self.trials if t.number == number)
        trial.state, trial.promoted = Trial.State.RUNNING, rung
        trial.tracker.changed = True
        if trial.job.status == Status.HALTED:
            trial.job = lifecycle.resume(trial.job, actor=self.actor)

    def end_if_done(self):
        if any(t.state == Trial.State.RUNNING for t in self.trials) or not self.out_of_trials():
            return
        last = self.search.promotions(self.views(), finishing=True) if self.asha else []
        if last:
            self.promote(*last[0])
            return
        for trial in self.trials:
            if trial.state == Trial.State.PAUSED:
                self.stop(trial)
        self.finish(Experiment.State.COMPLETED, self.experiment.state_reason or "every trial has run")

    # --- pause, resume, kill ------------------------------------------------------------------------
    def hold_running(self):
        for trial in self.trials:
            if trial.state == Trial.State.RUNNING and trial.job.status in ACTIVE - {Status.HALTING}:
                self.halt(trial, "the experiment is paused")

    def resume_held(self):
        for trial in self.trials:
            if trial.state == Trial.State.RUNNING and trial.job.status == Status.HALTED:
                trial.job = lifecycle.resume(trial.job, actor=self.actor)

    def stop_all(self):
        for trial in self.trials:
            if trial.state in (Trial.State.RUNNING, Trial.State.PAUSED):
                self.stop(trial)
        self.finish(Experiment.State.TERMINATED, self.experiment.state_reason)

    def stop(self, trial):
        if trial.job.status not in FINAL:
            lifecycle.terminate(trial.job, actor=self.actor)
        trial.state = Trial.State.STOPPED
        trial.tracker.changed = True

    def halt(self, trial, reason):
        try:
            trial.job = lifecycle.halt(trial.job, actor=self.actor, reason=reason)
        except InvalidTransition:
            return  # not running now (queued, storing, or already halting): a later pass tries again
        trial.tracker.changed = True

    def finish(self, state, reason):
        self.experiment.state, self.experiment.state_reason = state, reason
        self.experiment.finished_at = timezone.now()
        folder = storage.job_dir(self.experiment.tenant.slug, self.experiment.id)
        transaction.on_commit(lambda: datastores.delete_credentials(folder))

    # --- what the searcher sees, and the best ----------------------------------------------------------
    def views(self):
        return [searching.TrialView(number=t.number, params=t.params, state=str(t.state), system_attrs=t.system_attrs,
                                    rungs={int(k): v for k, v in t.rungs.items()}, promoted=t.promoted, value=t.value)
                for t in self.trials]

    def record_best(self):
        best = self.search.best(self.views())
        self.experiment.best_trial = best.number if best else None
        self.experiment.best_value = best.value if best else None


class _Tracker:
    """What one pass learnt of a trial: whether its row changed, its new (step, value) points."""

    def __init__(self):
        self.changed = False
        self.points = []


def _write_hparams(job, values):
    path = Path(storage.job_dir(job.tenant.slug, job.id), "results", HPARAMS_FILE)
    path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


# --- reading ------------------------------------------------------------------------------------
def experiments_of(membership):
    """The experiments this member may see: the tenant's, minus other people's private ones."""
    rows = Experiment.objects.filter(tenant=membership.tenant)
    if membership.is_admin:
        return rows
    return rows.filter(Q(private=False) | Q(owner=membership.user))


def experiment_or_404(membership, experiment_id):
    row = experiments_of(membership).filter(pk=experiment_id).first()
    if row is None:
        raise Http404(f"No experiment {experiment_id!r} in tenant {membership.tenant.slug!r}.")
    return row


def can_control(membership, experiment):
    if membership.is_admin:
        return True
    return membership.role == Membership.Role.RESEARCHER and experiment.owner_id == membership.user.pk


def rungs_of(experiment):
    """ASHA's milestones (steps of the metric) for an experiment row; [] for other searchers."""
    searcher = experiment.spec["searcher"]
    return experiments.Searcher(**searcher).rungs() if searcher["name"] == "asha" else []
