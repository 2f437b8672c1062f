"""Browser pages for experiments: the tenant's experiments, the form for a new one, and one experiment's
page (its trials, the searcher's metric charted per trial, a parallel-coordinates view) with Pause,
Resume, Kill and, once it has finished, Delete.

What the rows say is rendered at once, so the page is useful before any script runs;
static/js/experiment.js then draws the charts and keeps the page live over the REST API
(jobs/experiment_api.py). Every rule (who may see, create or control an experiment, which state allows
what) is jobs.experiments'; these views parse the request and call it.
"""
import math
import re
from dataclasses import dataclass

from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from jobs import compare, datastores, experiments
from jobs.models import Experiment, Trial
from portal import views
from tenants import throttling

LIST_ROWS = 200  # experiments on the list page, newest first
MAX_MANIFEST_BYTES = 64 * 1024
ACTIONS = {"pause": experiments.pause, "resume": experiments.resume, "kill": experiments.kill}
# The status-chip colours of the job pages, for an experiment's state and a trial's.
STATE_CHIPS = {"ACTIVE": "processing", "PAUSED": "halted", "COMPLETED": "completed", "TERMINATED": "terminated",
               "running": "processing", "paused": "halted", "completed": "completed", "stopped": "terminated",
               "failed": "failed"}


# --- the list ------------------------------------------------------------------------------------
@views.server_timing
@views.tenant_page
def experiment_list(request, membership):
    state = request.GET.get("state", "").upper()
    rows = experiments.experiments_of(membership).select_related("owner").order_by("-created_at")
    if state in Experiment.State.values:
        rows = rows.filter(state=state)
    else:
        state = ""
    count = rows.count()
    listed = list(experiments.listed(rows)[:LIST_ROWS])
    for experiment in listed:
        experiment.chip = STATE_CHIPS[experiment.state]
        experiment.best_text = format_value(experiment.best_value)
    return render(request, "experiments/list.html", {
        "membership": membership, "experiments": listed, "count": count, "state": state,
        "states": Experiment.State.values, "truncated": count > len(listed),
        "has_any": bool(listed) or experiments.experiments_of(membership).exists()})


# --- a new one -------------------------------------------------------------------------------------
def experiment_examples():
    """The examples that come with an experiment manifest (examples/NAME/experiment.yml)."""
    return sorted(p.parent.name for p in views.EXAMPLES.glob("*/experiment.yml"))


@views.tenant_page
@require_http_methods(["GET", "POST"])
def new_experiment(request, membership):
    """The form for a new experiment: its manifest (typed, or a file) and its code archive (or an
    example's folder); errors are shown in place, naming the field."""
    source = request.POST if request.method == "POST" else request.GET
    example = source.get("example", "")
    if example not in experiment_examples():
        example = ""
    context = {"membership": membership, "examples": experiment_examples(), "example": example,
               "manifest_text": "", "private": bool(request.POST.get("private")), "error": None, "field": None}
    if request.method == "GET":
        if example:
            context["manifest_text"] = (views.EXAMPLES / example / "experiment.yml").read_text()
        return render(request, "experiments/new.html", context)
    try:
        context["manifest_text"] = _manifest_text(request)
        with views.uploaded_code(request, example, None) as code_file:
            experiment = experiments.create(membership, manifest_bytes=context["manifest_text"].encode(),
                                            code_file=code_file, private=context["private"])
    except experiments.submission.SubmitError as exc:
        # "searcher.metric: is required" is shown as the field, in bold, then the rule.
        context.update(error=exc.detail.removeprefix(f"{exc.field}: ") if exc.field else exc.detail, field=exc.field,
                       manifest_error=bool(exc.field) and exc.field != "code")
        response = render(request, "experiments/new.html", context, status=exc.status)
        for header, value in exc.headers().items():
            response[header] = value
        return response
    return redirect("experiment-page", experiment_id=experiment.id)


def _manifest_text(request):
    """The manifest chosen as a file, else the one typed in."""
    upload = request.FILES.get("manifest_file")
    if upload is None:
        return request.POST.get("manifest", "")
    if upload.size > MAX_MANIFEST_BYTES:
        raise experiments.ExperimentError("the manifest file is larger than 64 KiB", field="manifest")
    try:
        return upload.read().decode("utf-8")
    except UnicodeDecodeError:
        raise experiments.ExperimentError("the manifest file is not UTF-8 text", field="manifest") from None


# --- one experiment --------------------------------------------------------------------------------
@views.server_timing
@views.tenant_page
def experiment_page(request, membership, experiment_id):
    experiment = experiments.experiment_or_404(membership, experiment_id)
    try:
        with experiments.reading_every_trial(experiment):
            return render(request, "experiments/detail.html", page_context(membership, experiment))
    except throttling.Busy as exc:
        response = render(request, "experiments/busy.html", {"membership": membership, "experiment": experiment,
                                                             "reason": str(exc)}, status=429)
        response["Retry-After"] = str(exc.retry_after_s)
        return response


@views.tenant_page
@require_POST
def experiment_action(request, membership, experiment_id, action):
    """Pause, Resume or Kill from the page's buttons; back to the page, or the page saying why not."""
    experiment = experiments.experiment_or_404(membership, experiment_id)
    if not experiments.can_control(membership, experiment):
        return render(request, "experiments/detail.html", page_context(
            membership, experiment, action_error=f"Only the experiment's owner and tenant admins can {action} it."),
            status=403)
    try:
        ACTIONS[action](experiment, actor=request.user.username)
    except experiments.ExperimentError as exc:
        experiment.refresh_from_db()
        return render(request, "experiments/detail.html",
                      page_context(membership, experiment, action_error=exc.detail), status=exc.status)
    return redirect("experiment-page", experiment_id=experiment.id)


def page_context(membership, experiment, *, action_error=None):
    spec = experiment.spec
    searcher = spec["searcher"]
    varied = [hp for hp in spec["hyperparameters"] if hp["type"] != "const"]
    milestones = experiments.rungs_of(experiment)
    trials = trial_rows(experiment, [hp["name"] for hp in varied], milestones)
    best = next((t for t in trials if t.is_best), None)
    states = [(state, sum(t.state == state for t in trials)) for state in Trial.State.values]
    return {
        "membership": membership, "experiment": experiment, "chip": STATE_CHIPS[experiment.state],
        "can_control": experiments.can_control(membership, experiment), "action_error": action_error,
        "searcher": searcher, "varied": [dict(hp, range=describe_range(hp)) for hp in varied],
        "constants": [(hp["name"], hp["vals"][0]) for hp in spec["hyperparameters"] if hp["type"] == "const"],
        "milestones": milestones, "trials": trials, "best": best, "best_text": format_value(experiment.best_value),
        "trial_states": states, "max_compare": compare.MAX_JOBS,
        "manifest_yaml": datastores.redact_yaml(experiment.manifest_yaml),
    }


@dataclass
class TrialRow:
    """One row of the trials table, as the page shows it and sorts it."""
    number: int
    job_id: str
    job_status: str
    state: str
    chip: str
    params: list  # (value as sorted, value as shown) per varied hyperparameter
    value: float | None
    value_text: str
    step: int | None
    rung: int  # rungs reached (ASHA), 0 for none
    rung_title: str
    is_best: bool


def trial_rows(experiment, names, milestones):
    rows = []
    for trial in experiment.trials.select_related("job").only(
            "number", "state", "params", "value", "step", "rungs", "job__id", "job__status").order_by("number"):
        reached = sorted(int(index) for index in trial.rungs)
        rows.append(TrialRow(
            number=trial.number, job_id=trial.job.id, job_status=trial.job.status, state=trial.state,
            chip=STATE_CHIPS[trial.state],
            params=[(sort_key(trial.params.get(name)), format_value(trial.params.get(name))) for name in names],
            value=trial.value, value_text=format_value(trial.value), step=trial.step,
            rung=reached[-1] + 1 if reached else 0,
            rung_title=" · ".join(f"step {milestones[i]}: {format_value(trial.rungs[str(i)])}"
                                  for i in reached if i < len(milestones)),
            is_best=trial.number == experiment.best_trial))
    return rows


def describe_range(hp):
    """A hyperparameter's search space in a few words: `0.0001–0.1, log`, `8, 16, 32`."""
    if hp["type"] == "categorical":
        return ", ".join(format_value(v) for v in hp["vals"])
    text = f"{format_value(hp['minval'])}–{format_value(hp['maxval'])}"
    extras = [word for word in ("log" if hp["type"] == "log" else "", "whole" if hp["type"] == "int" else "",
                                f"{hp['count']} grid points" if hp.get("count") else "") if word]
    return f"{text} ({', '.join(extras)})" if extras else text


def format_value(value):
    """A number as the page's scripts write it (static/js/experiment.js formatValue): five significant
    digits, an exponent only for the very large and very small; anything else as text."""
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return "—"
    if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-4):
        return re.sub(r"e([+-])0*(\d)", r"e\1\2", f"{value:.3e}")
    rounded = float(f"{value:.5g}")
    return str(int(rounded)) if rounded.is_integer() else repr(rounded)


def sort_key(value):
    """What a cell sorts by: numbers as numbers, anything else as its text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    return "" if value is None else str(value)
