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
no trial is started twice or lost. A trial's job folder is made before that commit: a pass that fails
removes the folders of the trials it stored, and what a killed one left is removed by the storage
sweep (jobs.reconcile.sweep_storage).

Trials are jobs like any other: they queue against the tenant's quota and fair share, at the manifest's
priority, may borrow and be preempted, and can be halted, resumed and terminated one by one.

The passes run in the loop that admits every tenant's jobs, so each is bounded: a few new trials, a few
decisions (DECISIONS_PER_PASS), the searcher's view of the trials built once; what is left waits in the
rows for the next pass, which the loop is woken for. `advance_all` gives all the passes of one cycle a
time budget and lets the experiments it did not reach go first in the next cycle.
"""
import itertools
import json
import logging
import math
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import yaml
from django.conf import settings
from django.db import transaction
from django.db.models import Exists, IntegerField, OuterRef, Q
from django.db.models.fields.json import KT
from django.db.models.functions import Cast
from django.http import Http404
from django.utils import timezone

from gpu_scheduler import search as searching
from jobs import datastores, dispatch, lifecycle, storage, submission, transfers
from jobs.models import ACTIVE, FINAL, Experiment, MetricPoint, Status, Trial
from jobs.states import InvalidTransition
from tenants import access, priority, quotas, throttling
from tenants.models import Membership, Tenant
from trainyard import experiment as experiments
from trainyard.manifest import ManifestError, parse_fields

log = logging.getLogger(__name__)
HPARAMS_FILE = "hparams.json"  # in each trial's results: the hyperparameters it ran with
# New trials one pass may start: an experiment reaches its max_concurrent_trials over a few cycles, and
# no tenant's search holds the scheduling loop, which admits every tenant's jobs, for long.
NEW_TRIALS_PER_PASS = 4
# TPE fits its model to the trials so far for every proposal: one a pass.
TPE_NEW_TRIALS_PER_PASS = 1
# What else one pass may do to its trials: judge one at a rung (a ranking of that rung's trials, and a
# halt when it pauses), promote, halt or resume one, or stop one of a killed experiment (a job's
# transition each). The rest is left in the rows for the next passes.
DECISIONS_PER_PASS = 32
# The searcher's metric points one pass reads: a learner may report up to its cap of them
# (TRAINYARD_METRIC_POINTS_PER_LEARNER), all at once, and the rest wait for the next passes.
OBSERVED_POINTS_PER_PASS = 10_000
# An experiment of more trials than this is read whole a few at a time per tenant (reading_every_trial).
FREE_READ_TRIALS = 1000


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
    stored = _storable(spec)
    _check_unfinished(membership.tenant)
    upload, info = submission.checked_code(code_file)
    experiment = Experiment(
        tenant=membership.tenant, owner=membership.user, name=spec.name, description=spec.manifest.description,
        spec=stored, manifest_yaml=datastores.redact_yaml(manifest_bytes.decode("utf-8")),
        searcher=spec.searcher.name, metric=spec.searcher.metric, smaller_is_better=spec.searcher.smaller_is_better,
        private=private, code_sha256=storage.sha256_of(upload), code_bytes=upload.stat().st_size)
    slug = membership.tenant.slug
    try:
        folder = storage.stage_dir(slug, experiment.id)
        with storage.removed_on_error(slug, experiment.id):
            _store_shared_code(upload, folder / f"code.{info.kind}")
            transfers.seal_submitted_credentials(folder, spec.manifest)
        with transaction.atomic(), storage.removed_on_error(slug, experiment.id):
            _check_unfinished(membership.tenant, lock=True)
            experiment.save(force_insert=True)
            storage.unstage_on_commit(slug, experiment.id)
            dispatch.wake_scheduler_on_commit()
    finally:
        upload.unlink(missing_ok=True)
    return experiment


def _storable(spec):
    """What the experiment's row keeps (credentials redacted), refused unless its passes can read it
    back: a manifest the redaction makes break a rule would otherwise be an experiment no pass can run."""
    stored = spec.to_json()
    stored["fields"] = datastores.redact(stored["fields"])
    try:
        experiments.from_json(stored)
    except ManifestError as exc:
        raise ExperimentError(f"{exc} (as stored, with its data-store credentials redacted: leave out credential "
                              "fields that are blank)", field=exc.field) from None
    return stored


def _check_unfinished(tenant, *, lock=False):
    """429 while the tenant has as many experiments not finished as it may: each costs the scheduling
    loop a pass every cycle. `lock`: counted under the tenant's row lock, so creations racing each
    other cannot pass the limit together (checked once before too, so a refused one costs no archive check)."""
    if lock:
        Tenant.objects.select_for_update(no_key=True).filter(pk=tenant.pk).first()
    unfinished = Experiment.objects.filter(tenant=tenant, finished_at=None).count()
    if unfinished >= settings.MAX_EXPERIMENTS:
        raise ExperimentError(f"too many experiments: tenant {tenant.slug!r} has {unfinished} not finished, the most "
                              f"it may have (TRAINYARD_MAX_EXPERIMENTS={settings.MAX_EXPERIMENTS}); kill one or wait "
                              "for one to end", status=429)


def _store_shared_code(upload, target):
    """The experiment's code archive, which every trial's job links to: read-only, so no job can change
    what the others run."""
    shutil.copyfile(upload, target)
    os.chmod(target, target.stat().st_mode & ~0o222)


# --- user actions -------------------------------------------------------------------------------
def pause(experiment, *, actor):
    """No trial starts; running ones are halted through their checkpoints (a queued one as soon as it
    is admitted) and resume with the experiment."""
    return _set_state(experiment, Experiment.State.PAUSED, {Experiment.State.ACTIVE}, f"paused by {actor}")


def resume(experiment, *, actor):
    return _set_state(experiment, Experiment.State.ACTIVE, {Experiment.State.PAUSED}, f"resumed by {actor}")


def kill(experiment, *, actor):
    """Stop for good: the trials' jobs are terminated by the passes, a bounded number each, the first
    of them here (a small experiment ends at once; a large one holds no request)."""
    row = _set_state(experiment, Experiment.State.TERMINATED, {Experiment.State.ACTIVE, Experiment.State.PAUSED},
                     f"killed by {actor}")
    try:
        advance(row.pk, wait=False)
    except Exception:  # noqa: BLE001 - the kill is committed: the loop's passes stop the trials
        log.exception("experiment %s: the pass after its kill failed; the scheduling loop's passes go on", row.pk)
    row.refresh_from_db()
    return row


def _set_state(experiment, target, sources, reason):
    with transaction.atomic():
        row = Experiment.objects.select_for_update().get(pk=experiment.pk)
        if row.state not in sources:
            raise ExperimentError(f"experiment {row.id} is {row.state}; only an experiment that is "
                                  f"{' or '.join(sorted(sources))} can be {reason.split()[0]}", status=409)
        row.state, row.state_reason, row.updated_at = target, reason, timezone.now()
        row.save(update_fields=["state", "state_reason", "updated_at"])
        dispatch.wake_scheduler_on_commit()
    return row


# --- the loop's pass ----------------------------------------------------------------------------
_not_reached = []  # the experiments the last advance_all() ran out of time for: first in line next time


@contextmanager
def reading_every_trial(experiment):
    """The block that reads every trial of `experiment` (its page, its API detail). Past
    FREE_READ_TRIALS that takes a web thread and its CPU for a good part of a second: the block then
    holds one of the tenant's EXPERIMENT_READS slots (throttling.Busy, a 429, when they are taken), so
    a tenant reading its large experiments in a loop does not take the web process from the others."""
    if experiment.trials_started <= FREE_READ_TRIALS:
        yield
        return
    with throttling.held(throttling.EXPERIMENT_READS, experiment.tenant_id):
        yield


def advance_all(*, budget_s=None):
    """One pass over each experiment that needs one (the scheduling loop calls this each cycle), within
    `budget_s` seconds (TRAINYARD_EXPERIMENTS_PASS_SECONDS) for all of them: past it, the ones not
    reached go first next cycle, which is woken for them. A killed experiment counts until its passes
    have stopped its trials."""
    budget_s = settings.EXPERIMENTS_PASS_SECONDS if budget_s is None else budget_s
    deadline = time.monotonic() + budget_s
    order = _in_turn(_needing_a_pass(), _not_reached)
    for index, experiment_id in enumerate(order):
        if index and time.monotonic() >= deadline:
            _not_reached[:] = order[index:]
            dispatch.wake_scheduler()
            return
        try:
            advance(experiment_id)
        except Exception:
            log.exception("experiment %s: its pass failed; the next one tries again", experiment_id)
    _not_reached.clear()


def _needing_a_pass():
    """(id, tenant id) of the experiments not ended, oldest first, less the paused ones with nothing
    to observe (every open trial's job halted: nothing of theirs changes until a resume)."""
    stirring = (Trial.objects.filter(experiment=OuterRef("pk"), state__in=(Trial.State.RUNNING, Trial.State.PAUSED))
                .exclude(job__status=Status.HALTED))
    return list(Experiment.objects.filter(finished_at=None)
                .filter(~Q(state=Experiment.State.PAUSED) | Exists(stirring))
                .order_by("created_at", "id").values_list("id", "tenant_id"))


def _in_turn(rows, first):
    """The order of this cycle's passes: the experiments in `first` (not reached last time) keep their
    place at the head; the others alternate between tenants, so a tenant's many experiments do not all
    go before another tenant's one."""
    known = {experiment_id for experiment_id, _ in rows}
    head = [experiment_id for experiment_id in first if experiment_id in known]
    placed, per_tenant = set(head), {}
    for experiment_id, tenant_id in rows:
        if experiment_id not in placed:
            per_tenant.setdefault(tenant_id, []).append(experiment_id)
    alternating = itertools.zip_longest(*per_tenant.values())
    return head + [experiment_id for turn in alternating for experiment_id in turn if experiment_id is not None]


def advance(experiment_id, *, wait=True):
    """One pass over the experiment, under its row lock; `wait=False`: none when another holds it (the
    loop's own pass is under way)."""
    with transaction.atomic():
        experiment = (Experiment.objects.select_for_update(skip_locked=not wait, of=("self",))
                      .select_related("tenant", "owner").filter(pk=experiment_id).first())
        if experiment is None or experiment.finished_at is not None:
            return
        this_pass = Pass(experiment)
        try:
            this_pass.run()
        except BaseException:
            this_pass.discard_stored()  # rolled back with the pass: no row would own their folders
            raise


class Pass:
    """One pass over one locked experiment (module docstring)."""

    def __init__(self, experiment):
        self.experiment = experiment
        self.trials = list(trials_of(experiment))
        self.actor = f"experiment {experiment.id}"
        self.asha = experiment.searcher == "asha"
        self.allowance = DECISIONS_PER_PASS
        self.more = False  # work left for the next pass: the loop is woken for it
        self.behind = False  # metric points left for the next pass (OBSERVED_POINTS_PER_PASS): woken too
        self.stored = []  # the new trials' jobs, whose folders are theirs only once the pass commits
        self._views, self._places = None, {}
        try:
            self.spec = experiments.from_json(experiment.spec)
            self.search = searching.Search(self.spec)
        except (ManifestError, ValueError, TypeError, KeyError) as exc:
            self.spec = self.search = None  # the pass only settles it (set_aside)
            self.unreadable = str(exc)

    def run(self):
        before = self.recorded()
        for trial in self.trials:
            trial.tracker = _Tracker()
        if self.spec is None:
            self.set_aside()
        else:
            self.decide()
        for trial in self.trials:
            if trial.tracker.changed:
                trial.updated_at = timezone.now()
                trial.save()
        if self.recorded() != before:  # most passes over a running experiment change nothing
            self.experiment.updated_at = timezone.now()
            self.experiment.save()
        if self.more or self.behind:
            dispatch.wake_scheduler_on_commit()

    def decide(self):
        state = self.experiment.state
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

    def set_aside(self):
        """An experiment whose stored manifest no longer reads (a rule changed since it was created): it
        starts nothing, and is paused with the reason until it is killed, which still stops its trials."""
        for trial in self.trials:
            if trial.state in (Trial.State.RUNNING, Trial.State.PAUSED):
                self.see_job(trial)
        if self.experiment.state == Experiment.State.TERMINATED:
            self.stop_all()
            return
        self.experiment.state = Experiment.State.PAUSED
        self.experiment.state_reason = (f"paused: its stored manifest no longer passes the platform's rules "
                                        f"({self.unreadable}); kill it and create it again")
        self.hold_running()

    def spend(self):
        """Whether the pass may take one more decision (DECISIONS_PER_PASS); when not, the next pass will."""
        if self.allowance <= 0:
            self.more = True
            return False
        self.allowance -= 1
        return True

    def owner_may_not_submit(self):
        """Why the experiment's owner may not start its trials now ("" when they may): trials are jobs
        they submit, so an owner whose account is disabled, who left the tenant, is a viewer now, or may
        no longer ask for the trials' priority, starts none."""
        experiment, owner = self.experiment, self.experiment.owner
        if not owner.is_active:
            return f"paused: its owner {owner.username}'s account is disabled"
        try:  # as a request of theirs would act in the tenant (a platform admin: as its admin)
            membership = access.membership_for(owner, experiment.tenant.slug)
        except access.NoTenant:
            return f"paused: its owner {owner.username} is no longer a member of {experiment.tenant.slug}"
        if not membership.can_submit:
            return f"paused: its owner {owner.username} is a {membership.role} and may not submit jobs"
        try:
            priority.may_ask(membership, self.spec.manifest.priority)
        except priority.PriorityRefused as exc:
            return f"paused: its owner {owner.username} may no longer start its trials ({exc})"
        return ""

    def recorded(self):
        """What a pass may change of the experiment's row."""
        row = self.experiment
        return (row.state, row.state_reason, row.trials_started, row.best_trial, row.best_value, row.points_seen,
                row.finished_at, row.spec.get("exhausted"))

    # --- 1. observe -------------------------------------------------------------------------------
    def observe(self):
        """The trials' new points, up to OBSERVED_POINTS_PER_PASS (the rest the next passes), and their
        jobs' ends: a trial whose job ended is settled once every point of it is read."""
        open_trials = {t.job_id: t for t in self.trials if t.state in (Trial.State.RUNNING, Trial.State.PAUSED)}
        unread = set()
        if open_trials:
            points = list(MetricPoint.objects.filter(job_id__in=list(open_trials), name=self.experiment.metric,
                                                     id__gt=self.experiment.points_seen)
                          .order_by("id").values_list("id", "job_id", "step", "value")[:OBSERVED_POINTS_PER_PASS])
            for point_id, job_id, step, value in points:
                self.experiment.points_seen = max(self.experiment.points_seen, point_id)
                if value is not None and math.isfinite(value):
                    trial = open_trials[job_id]
                    trial.value, trial.step = value, step
                    self.changed(trial)
                    trial.tracker.points.append((step, value))
            if len(points) == OBSERVED_POINTS_PER_PASS:
                self.behind = True
                unread = self.with_unread_points([t for t in open_trials.values() if t.job.status in FINAL])
        if self.asha:
            self.rungs_reached()
        for trial in open_trials.values():
            if trial.job_id not in unread:
                self.see_job(trial)

    def with_unread_points(self, trials):
        """The job ids of those of `trials` with points of the metric this pass has not read."""
        unread = MetricPoint.objects.filter(job_id=OuterRef("job_id"), name=self.experiment.metric,
                                            id__gt=self.experiment.points_seen)
        return set(Trial.objects.filter(pk__in=[t.pk for t in trials]).filter(Exists(unread))
                   .values_list("job_id", flat=True)) if trials else set()

    def rungs_reached(self):
        """Record the rung each running trial reached with this pass's points, all first, then decide for
        each (so trials that got there together compete together), as many as the pass may: a trial
        whose rung is recorded and not yet decided waits for the next pass, running on meanwhile. One
        let go on may have reached the next rung already."""
        for trial in self.trials:
            if trial.state == Trial.State.RUNNING and self.record_next_rung(trial):
                self.changed(trial)
        if self.experiment.state == Experiment.State.TERMINATED:
            return  # its trials are stopped, not judged
        for trial in [t for t in self.trials if t.state == Trial.State.RUNNING and self.at_a_rung(t)]:
            if not self.spend():
                return
            self.decide_at_rung(trial)

    def at_a_rung(self, trial):
        """Whether the trial has reached the rung after the last it was let go on from: it awaits a decision."""
        rung = trial.promoted + 1
        return rung < len(self.spec.searcher.rungs()) - 1 and str(rung) in trial.rungs

    def decide_at_rung(self, trial):
        while True:
            rung = trial.promoted + 1
            if self.search.goes_on(self.views(), trial.number, rung):
                trial.promoted = rung
                self.changed(trial)
                if self.record_next_rung(trial):
                    continue
                return
            trial.state = Trial.State.PAUSED
            self.changed(trial)
            if self.would_promote_last(trial):
                trial.state, trial.promoted = Trial.State.RUNNING, rung
                self.changed(trial)
                return
            self.halt(trial, f"paused at rung {rung + 1} ({self.spec.searcher.metric} "
                             f"{trial.rungs[str(rung)]:.4g} at step {self.spec.searcher.rungs()[rung]}): not "
                             f"among the best 1/{self.spec.searcher.divisor} there")
            return

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
            if self.asha and self.spec is not None and trial.value is not None:
                trial.rungs[str(len(self.spec.searcher.rungs()) - 1)] = trial.value
        elif status == Status.FAILED:
            trial.state = Trial.State.FAILED
        elif status == Status.TERMINATED:
            trial.state = Trial.State.STOPPED
        else:
            return
        self.changed(trial)

    def settle_value(self, trial):
        """The metric's last value, read again at the end (a point may have committed after a later one's id)."""
        last = (MetricPoint.objects.filter(job_id=trial.job_id, name=self.experiment.metric)
                .order_by("-id").values_list("step", "value").first())
        if last is not None and last[1] is not None and math.isfinite(last[1]):
            trial.step, trial.value = last

    # --- 2/3. fill ----------------------------------------------------------------------------------
    def fill(self):
        """Paused trials now good enough first (ASHA), then new configurations, while trial slots are free."""
        room = self.spec.searcher.max_concurrent_trials - sum(t.state == Trial.State.RUNNING for t in self.trials)
        if self.asha:
            room = self.promote_paused(room)
        if room > 0 and not self.more:  # promotions left for the next pass go before new configurations
            self.start_new(min(room, TPE_NEW_TRIALS_PER_PASS if self.spec.searcher.name == "tpe"
                               else NEW_TRIALS_PER_PASS))

    def promote_paused(self, room):
        """Promote paused trials into free slots, as many as the pass may; the slots left. The ranking is
        read once: promoting one changes no other's place."""
        for number, rung in self.search.promotions(self.views()) if room > 0 else []:
            trial = self.trial_numbered(number)
            if trial.state != Trial.State.PAUSED:  # promotable from two rungs: promoted from the higher
                continue
            if room <= 0 or not self.spend():
                break
            self.promote(trial, rung)
            room -= 1
        return room

    def start_new(self, count):
        """Up to `count` new configurations, each as a trial; why no more may start, on the experiment."""
        if self.out_of_trials():
            return
        if why := self.storage_full():
            self.experiment.state_reason = f"waiting: {why}"
            return
        queue_room = submission.queue_room(self.experiment.tenant)
        for _ in range(count):
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
            if not self.start_trial(proposal):
                return
            queue_room -= 1

    def storage_full(self):
        """Why no trial may start while the tenant's stored output fills its storage quota ("" when it may):
        a trial's results could only be stored past it."""
        quota = quotas.quota_of(self.experiment.tenant)
        if quota is None or quota.storage_bytes is None:
            return ""
        return quotas.storage_state(quota, quotas.stored_bytes(self.experiment.tenant))[1]

    def out_of_trials(self):
        searcher = self.spec.searcher
        if self.experiment.spec.get("exhausted") or self.experiment.trials_started >= searcher.max_trials:
            return True
        if searcher.max_gpu_hours is not None and quotas.records_usage(quotas.UsageRecord.objects.filter(
                job__trial__experiment=self.experiment))["gpu_hours"] >= searcher.max_gpu_hours:
            self.experiment.state_reason = f"its budget of {searcher.max_gpu_hours} GPU-hours is spent"
            return True
        return False

    def start_trial(self, proposal):
        """Store the proposal's trial as a job of the owner; False, with the reason on the experiment, when
        the tenant's limits refuse it now (the pass's observations and decisions commit all the same)."""
        number = self.experiment.trials_started
        values = {**self.spec.constants(), **proposal.params}
        fields = experiments.trial_fields(self.spec, proposal.params, number)
        tenant, folder = self.experiment.tenant, storage.job_dir(self.experiment.tenant.slug, self.experiment.id)
        try:
            manifest = parse_fields(json.loads(json.dumps(fields)))
        except ManifestError as exc:  # a rule changed since the experiment was created: no trial can start
            self.experiment.state = Experiment.State.PAUSED
            self.experiment.state_reason = f"paused: trial {number}'s manifest breaks a rule now ({exc})"
            return False
        code = next(iter(sorted(folder.glob("code.*"))))
        try:
            job = submission.store_job(
                tenant, self.experiment.owner, manifest, yaml.safe_dump(fields, sort_keys=False), code,
                code.name.removeprefix("code."), private=self.experiment.private,
                disk_caps=submission.disk_caps_for(tenant, manifest, quotas.quota_of(tenant)),
                credentials=transfers.sealed_credentials(folder), code_sha256=self.experiment.code_sha256,
                link_code=True, queue_limit=quotas.intake_of(quotas.quota_of(tenant)),
                runtime_extra={"hyperparameters": values, "experiment": {"id": self.experiment.id, "trial": number}})
        except submission.SubmitError as exc:
            self.experiment.state_reason = f"waiting: {exc.detail}"
            return False
        self.stored.append(job)
        _write_hparams(job, values)
        trial = Trial.objects.create(experiment=self.experiment, number=number, job=job, params=values,
                                     system_attrs=proposal.system_attrs)
        trial.tracker = _Tracker()
        self.trials.append(trial)
        if self._views is not None:
            self._views.append(_view(trial))
            self._places[trial.number] = len(self._views) - 1
        self.experiment.trials_started = number + 1
        self.experiment.state_reason = ""
        return True

    def discard_stored(self):
        """Remove the folders of the trials' jobs this pass stored, when it fails before its commit. One
        killed outright, or whose commit failed (its outcome unknown here), leaves them to the storage
        sweep (jobs.reconcile.sweep_storage), which removes a folder once it is sure no row owns it."""
        for job in self.stored:
            storage.remove_job_dir(job.tenant.slug, job.id)

    def promote(self, trial, rung):
        trial.state, trial.promoted = Trial.State.RUNNING, rung
        self.changed(trial)
        if trial.job.status == Status.HALTED:
            trial.job = lifecycle.resume(trial.job, actor=self.actor)

    def trial_numbered(self, number):
        self.views()  # builds the index of places
        return self.trials[self._places[number]]

    def end_if_done(self):
        if any(t.state == Trial.State.RUNNING for t in self.trials) or not self.out_of_trials():
            return
        last = self.search.promotions(self.views(), finishing=True) if self.asha else []
        if last:
            number, rung = last[0]
            self.promote(self.trial_numbered(number), rung)
            return
        paused = [t for t in self.trials if t.state == Trial.State.PAUSED]
        if self.stop_some(paused):
            self.finish(Experiment.State.COMPLETED, self.experiment.state_reason or "every trial has run")

    # --- pause, resume, kill ------------------------------------------------------------------------
    def hold_running(self):
        for trial in self.trials:
            if trial.state == Trial.State.RUNNING and trial.job.status in ACTIVE - {Status.HALTING}:
                if not self.spend():
                    return
                self.halt(trial, "the experiment is paused")

    def resume_held(self):
        for trial in self.trials:
            if trial.state == Trial.State.RUNNING and trial.job.status == Status.HALTED:
                if not self.spend():
                    return
                trial.job = lifecycle.resume(trial.job, actor=self.actor)

    def stop_all(self):
        open_trials = [t for t in self.trials if t.state in (Trial.State.RUNNING, Trial.State.PAUSED)]
        if self.stop_some(open_trials):
            self.finish(Experiment.State.TERMINATED, self.experiment.state_reason)

    def stop_some(self, trials):
        """Stop the trials, as many as the pass may; whether every one is stopped."""
        for trial in trials:
            if not self.spend():
                return False
            self.stop(trial)
        return True

    def stop(self, trial):
        if trial.job.status not in FINAL:
            lifecycle.terminate(trial.job, actor=self.actor)
        trial.state = Trial.State.STOPPED
        self.changed(trial)

    def halt(self, trial, reason):
        try:
            trial.job = lifecycle.halt(trial.job, actor=self.actor, reason=reason)
        except InvalidTransition:
            return  # not running now (queued, storing, or already halting): a later pass tries again
        self.changed(trial)

    def finish(self, state, reason):
        self.experiment.state, self.experiment.state_reason = state, reason
        self.experiment.finished_at = timezone.now()
        folder = storage.job_dir(self.experiment.tenant.slug, self.experiment.id)
        transaction.on_commit(lambda: datastores.delete_credentials(folder))

    # --- what the searcher sees, and the best ----------------------------------------------------------
    def views(self):
        """Every trial as the searcher sees it, built once a pass; changed() renews a trial's view as the
        pass changes the trial, so each decision reads them without building them all again."""
        if self._views is None:
            self._views = [_view(t) for t in self.trials]
            self._places = {t.number: place for place, t in enumerate(self.trials)}
        return self._views

    def changed(self, trial):
        """The trial's row is to be saved, and the searcher sees it as it is now."""
        trial.tracker.changed = True
        if self._views is not None:
            self._views[self._places[trial.number]] = _view(trial)

    def record_best(self):
        best = self.search.best(self.views())
        self.experiment.best_trial = best.number if best else None
        self.experiment.best_value = best.value if best else None


def _view(trial):
    return searching.TrialView(number=trial.number, params=trial.params, state=str(trial.state),
                               system_attrs=trial.system_attrs, rungs={int(k): v for k, v in trial.rungs.items()},
                               promoted=trial.promoted, value=trial.value)


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
    """The experiments this member may see: the tenant's not deleted, minus other people's private ones."""
    rows = Experiment.objects.filter(tenant=membership.tenant, deleted_at=None)
    if membership.is_admin:
        return rows
    return rows.filter(Q(private=False) | Q(owner=membership.user))


def trials_of(experiment):
    """The experiment's trials in number order, each with its job as the passes and an experiment's
    answer read it: not the manifest, runtime and description every trial's job keeps a copy of (its
    experiment's, up to 64 KiB, for each of thousands of trials)."""
    return (experiment.trials.select_related("job")
            .defer("job__description", "job__manifest", "job__manifest_yaml", "job__runtime").order_by("number"))


def listed(rows):
    """The experiments `rows` as a list shows them: without their manifests (`spec` and `manifest_yaml`,
    up to 64 KiB each, which a tenant may keep for every experiment it ever ran), with the searcher's
    limits read from the spec by the database."""
    return rows.defer("spec", "manifest_yaml").annotate(
        max_trials=Cast(KT("spec__searcher__max_trials"), IntegerField()),
        max_concurrent_trials=Cast(KT("spec__searcher__max_concurrent_trials"), IntegerField()))


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
