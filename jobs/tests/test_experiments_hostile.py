"""A hostile review of experiments: what one tenant's search may cost the scheduling loop and the web
process every tenant shares. jobs/tests/test_experiment_passes.py has the passes' other bounds;
tests/security/test_experiment_input.py the hostile manifests."""
import json
import time
import tracemalloc

import pytest
from django.test import Client
from django.utils import timezone

from jobs import experiments
from jobs.models import Experiment, Job, MetricPoint, Status, Trial
from jobs.states import transition
from tests.support.builders import WAKE_SCHEDULER, client_for, member, record_sends, tar_gz, upload
from trainyard.experiment import parse_experiment
from trainyard.manifest import ManifestError

pytestmark = pytest.mark.django_db

RANDOM = {"name": "random", "metric": "acc", "max_trials": 20, "max_concurrent_trials": 2}
ASHA = {"name": "asha", "metric": "acc", "max_trials": 20, "max_concurrent_trials": 3, "max_length": 9, "divisor": 3}


def manifest(searcher):
    return (b"name: sweep\ncpus: 1\nmemory: 1GiB\n"
            b"framework: {name: custom, command: 'python t.py {{hparams.lr}}'}\n"
            b"checkpoint: {signal: SIGTERM, grace_seconds: 5}\n"
            b"hyperparameters: {lr: {type: log, minval: 0.001, maxval: 0.1}}\n"
            + f"searcher: {json.dumps(searcher)}\n".encode())


@pytest.fixture
def sent(monkeypatch):
    monkeypatch.setattr(experiments, "_not_reached", [], raising=False)
    return record_sends(monkeypatch)


@pytest.fixture
def alice(sent):
    return member("team-a", "alice")


def running_trials(membership, searcher, count):
    """An experiment with `count` trials started, their jobs running."""
    experiment = experiments.create(membership, manifest_bytes=manifest(searcher),
                                    code_file=upload(tar_gz({"t.py": b"print(1)\n"})))
    while Trial.objects.filter(experiment=experiment).count() < count:
        experiments.advance(experiment.id)
    trials = list(Trial.objects.filter(experiment=experiment).select_related("job").order_by("number"))
    for trial in trials:
        for status in (Status.PENDING, Status.PROCESSING):
            transition(trial.job_id, status, actor="test", attempt=trial.job.attempt)
    return experiment, trials


def flood(job, count, *, first_step=1):
    """`count` points of the searcher's metric, as a learner flooding it (up to its per-learner cap)
    leaves them."""
    now = timezone.now()
    MetricPoint.objects.bulk_create(
        [MetricPoint(job=job, name="acc", step=step, value=step / 1e9, time=now)
         for step in range(first_step, first_step + count)], batch_size=5000)


def last_point_id(job):
    return MetricPoint.objects.filter(job=job).order_by("-id").values_list("id", flat=True).first()


# --- the points a pass reads --------------------------------------------------------------------------
def test_it_reads_a_bounded_number_of_metric_points_a_pass_and_the_rest_the_next(alice, sent):
    experiment, (trial, _) = running_trials(alice, RANDOM, 2)
    flood(trial.job, 50_000)
    sent.clear()
    started = time.monotonic()
    experiments.advance(experiment.id)
    one_pass = time.monotonic() - started
    experiment.refresh_from_db()
    read = MetricPoint.objects.filter(job=trial.job, id__lte=experiment.points_seen).count()
    assert 0 < read <= 20_000, read  # a flooded metric is read over several passes, not in one
    assert WAKE_SCHEDULER in sent  # which come soon
    assert one_pass < 2.0
    for _ in range(10):
        experiments.advance(experiment.id)
    experiment.refresh_from_db()
    trial.refresh_from_db()
    assert experiment.points_seen == last_point_id(trial.job)
    assert (trial.step, trial.value) == (50_000, 50_000 / 1e9)


def test_a_trial_that_ended_is_settled_once_its_points_are_read(alice, monkeypatch):
    """ASHA: a trial whose job ended before the passes read its points still has its first rung's value
    recorded (it ranks the other trials there), and is settled once they are read."""
    monkeypatch.setattr(experiments, "OBSERVED_POINTS_PER_PASS", 5, raising=False)
    experiment, (first, second, _) = running_trials(alice, ASHA, 3)
    flood(second.job, 5, first_step=-4)  # before its first rung: these five fill the first pass
    flood(first.job, 9)  # rungs at steps 1, 3 and 9: it trained to the end, then its job completed
    for status in (Status.STORING, Status.COMPLETED):
        transition(first.job_id, status, actor="test", attempt=first.job.attempt)
    experiments.advance(experiment.id)
    first.refresh_from_db()
    assert first.state == Trial.State.RUNNING  # its points are not read yet
    for _ in range(3):
        experiments.advance(experiment.id)
    first.refresh_from_db()
    assert first.state == Trial.State.COMPLETED
    assert first.rungs["0"] == 1 / 1e9
    assert (first.step, first.value) == (9, 9 / 1e9)
    assert Experiment.objects.get(pk=experiment.pk).points_seen == last_point_id(first.job)


# --- the lists ---------------------------------------------------------------------------------------
def big_manifest(searcher):
    """A manifest near the 64 KiB a manifest may have: a long command, which the lists do not show."""
    return manifest(searcher).replace(b"{{hparams.lr}}", b"{{hparams.lr}} # " + b"c" * 60_000, 1)


def many_experiments(membership, count):
    """`count` experiments of the member with manifests near the largest, as a tenant that kept every
    finished experiment has them."""
    first = experiments.create(membership, manifest_bytes=big_manifest(RANDOM),
                               code_file=upload(tar_gz({"t.py": b"print(1)\n"})))
    columns = {field.attname: getattr(first, field.attname) for field in Experiment._meta.concrete_fields}
    Experiment.objects.bulk_create([Experiment(**{**columns, "id": f"exp-many{index:06d}"})
                                    for index in range(count - 1)])
    return first


def peak_bytes(call):
    tracemalloc.start()
    try:
        answer = call()
        return answer, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_experiments_list_loads_no_manifests(alice, django_assert_max_num_queries):
    many_experiments(alice, 300)
    client = client_for(alice)
    with django_assert_max_num_queries(12):
        answer, peak = peak_bytes(lambda: client.get("/api/v1/experiments/"))
    assert answer.status_code == 200
    assert len(answer.json()["results"]) == 300
    assert {(row["max_trials"], row["max_concurrent_trials"]) for row in answer.json()["results"]} == {(20, 2)}
    assert peak < 16 * 2**20, peak  # the manifests the rows keep (300 of 120 KiB) are not read


def test_the_experiments_page_loads_no_manifests(alice, django_assert_max_num_queries):
    many_experiments(alice, 200)
    browser = Client()
    browser.force_login(alice.user)
    with django_assert_max_num_queries(20):
        answer, peak = peak_bytes(lambda: browser.get("/experiments/"))
    assert answer.status_code == 200
    assert answer.content.count(b"0 / 20</td>") == 200
    assert peak < 16 * 2**20, peak


# --- the manifest -------------------------------------------------------------------------------------
def test_hyperparameters_whose_names_differ_only_in_case_are_refused_naming_the_second():
    """Each is TRAINYARD_HP_<NAME upper-cased> in a trial's environment: one would hide the other's value."""
    with pytest.raises(ManifestError) as refused:
        parse_experiment("name: x\nframework: {name: custom, command: 'echo {{hparams.lr}} {{hparams.LR}}'}\n"
                         "hyperparameters: {lr: {type: categorical, vals: [1, 2]}, LR: 3}\n"
                         "searcher: {name: grid, metric: acc}\n")
    assert refused.value.field == "hyperparameters.LR"
    assert "TRAINYARD_HP_LR" in str(refused.value)


# --- the trials' jobs ------------------------------------------------------------------------------------
def many_trials(membership, count):
    """An experiment of a manifest near the largest whose first trial runs and `count` more completed,
    as a long search has them; each trial's job keeps its own copy of the manifest."""
    experiment = experiments.create(membership, manifest_bytes=big_manifest({**RANDOM, "max_trials": 10_000}),
                                    code_file=upload(tar_gz({"t.py": b"print(1)\n"})))
    experiments.advance(experiment.id)
    first = Trial.objects.select_related("job").filter(experiment=experiment).first()
    job_columns = {field.attname: getattr(first.job, field.attname) for field in Job._meta.concrete_fields}
    jobs = Job.objects.bulk_create([Job(**{**job_columns, "id": f"training-many{index:06d}", "status": Status.COMPLETED})
                                    for index in range(count)])
    trial_columns = {field.attname: getattr(first, field.attname) for field in Trial._meta.concrete_fields
                     if not field.primary_key}
    Trial.objects.bulk_create([Trial(**{**trial_columns, "number": 100 + index, "job_id": job.id,
                                        "state": Trial.State.COMPLETED, "value": index / count})
                               for index, job in enumerate(jobs)])
    return experiment


def test_a_pass_reads_no_trials_manifests(alice):
    experiment = many_trials(alice, 300)
    _, peak = peak_bytes(lambda: experiments.advance(experiment.id))
    assert peak < 16 * 2**20, peak  # the manifests of 300 trials' jobs (180 KiB each) are not read
    assert Experiment.objects.get(pk=experiment.pk).best_trial == 399


def test_an_experiments_answer_reads_no_trials_manifests(alice, django_assert_max_num_queries):
    experiment = many_trials(alice, 300)
    client = client_for(alice)
    with django_assert_max_num_queries(12):
        answer, peak = peak_bytes(lambda: client.get(f"/api/v1/experiments/{experiment.id}/"))
    assert answer.status_code == 200
    assert [trial["job_status"] for trial in answer.json()["trials"]][-2:] == [Status.COMPLETED] * 2
    assert peak < 16 * 2**20, peak


@pytest.mark.parametrize("value", ["a\\x9b31mb", "a\\x85b", "\\x80"])
def test_a_value_with_a_c1_control_character_is_refused_naming_the_field(value):
    """A control character is refused, the C1 ones (U+0080..U+009F, a terminal's CSI among them) too."""
    with pytest.raises(ManifestError) as refused:
        parse_experiment("name: x\nframework: {name: custom, command: 'echo {{hparams.opt}}'}\n"
                         f'hyperparameters: {{opt: {{type: categorical, vals: ["{value}", b]}}}}\n'
                         "searcher: {name: grid, metric: acc}\n")
    assert refused.value.field == "hyperparameters.opt.vals[0]"
    assert "control character" in str(refused.value)
