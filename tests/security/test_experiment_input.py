"""Hostile experiment manifests: a hyperparameter value cannot reach the shell as code, names cannot
smuggle environment variables, and sizes that would flood the queue or the server are refused, each
naming its field. (Another tenant's experiment being a 404 is jobs/tests/test_experiment_api's.)"""
import json
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainyard.experiment import environment, parse_experiment, render_command, trial_fields
from trainyard.manifest import ManifestError

BASE = "name: hostile\nframework: {name: custom, command: 'echo {{hparams.opt}}'}\n"


def experiment(hyperparameters, searcher="{name: grid, metric: acc}"):
    return parse_experiment(f"{BASE}hyperparameters: {hyperparameters}\nsearcher: {searcher}\n")


@pytest.mark.parametrize("value", ["; touch /tmp/pwned", "$(id)", "`id`", "a' ; id ; '", "x\ny", "--flag=$HOME"])
def test_a_hyperparameter_value_reaches_the_command_as_one_quoted_word(value):
    spec = experiment(json.dumps({"opt": {"type": "categorical", "vals": [value]}}))
    command = trial_fields(spec, {"opt": value}, 0)["framework"]["command"]
    printed = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout
    assert printed == value + "\n"


def test_render_command_quotes_whatever_it_is_given():
    assert render_command("run {{hparams.x}}", {"x": "a b; c"}) == "run 'a b; c'"


@pytest.mark.parametrize("name", ["PATH=/evil", "lr-x", "1lr", "a" * 65, "../x"])
def test_a_hyperparameter_name_is_an_identifier(name):
    with pytest.raises(ManifestError, match=r"hyperparameters\."):
        experiment(f"{{'{name}': {{type: categorical, vals: [1, 2]}}, opt: {{type: categorical, vals: [1, 2]}}}}")


def test_the_environment_names_only_the_validated_names():
    assert set(environment({"lr": 0.1, "opt": "x"})) == {"TRAINYARD_HP_LR", "TRAINYARD_HP_OPT", "TRAINYARD_HPARAMS"}


@pytest.mark.parametrize("searcher, field", [
    ("{name: random, metric: acc, max_trials: 10001}", "searcher.max_trials"),
    ("{name: random, metric: acc, max_concurrent_trials: 100000}", "searcher.max_concurrent_trials"),
    ("{name: random, metric: acc, max_gpu_hours: .nan}", "searcher.max_gpu_hours"),
    ("{name: asha, metric: acc, max_length: 0}", "searcher.max_length"),
    ("{name: shell, metric: acc}", "searcher.name"),
    ("{name: random, metric: acc, command: id}", "searcher.command"),
])
def test_sizes_that_would_flood_the_platform_are_refused_naming_the_field(searcher, field):
    with pytest.raises(ManifestError) as refused:
        experiment("{opt: {type: categorical, vals: [1, 2]}}", searcher)
    assert field in str(refused.value)


def test_too_many_choices_or_hyperparameters_are_refused():
    with pytest.raises(ManifestError, match="1..100 choices"):
        experiment("{opt: {type: categorical, vals: [%s]}}" % ", ".join(map(str, range(101))))
    many = ", ".join(f"h{i}: {{type: categorical, vals: [1, 2]}}" for i in range(33))
    with pytest.raises(ManifestError, match="at most 32"):
        experiment(f"{{opt: {{type: categorical, vals: [1]}}, {many}}}")


_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6)
                       | st.sampled_from(["grid", "asha", "int", "log", "categorical", "const", "acc"]),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                           st.sampled_from(["type", "minval", "maxval", "count", "vals", "val", "name", "metric",
                                            "max_length", "min_length", "seed", "lr"]) | st.text(max_size=4),
                           inner, max_size=4), max_leaves=16)


@settings(max_examples=300, deadline=None)
@given(hyperparameters=_VALUES, searcher=_VALUES)
def test_any_hyperparameters_and_searcher_give_an_experiment_or_errors_naming_where(hyperparameters, searcher):
    try:
        experiment(json.dumps(hyperparameters), json.dumps(searcher))
    except ManifestError as error:
        assert all(problem.field and problem.rule for problem in error.problems), error.problems


@pytest.mark.parametrize("hyperparameters, field", [
    ('{opt: {type: categorical, vals: ["a\\0b", "c"]}}', "hyperparameters.opt.vals[0]"),
    ('{opt: {type: categorical, vals: [1, 2]}, c: "x\\0"}', "hyperparameters.c.val"),
    ('{opt: {type: categorical, vals: ["\\e[31mred", "c"]}}', "hyperparameters.opt.vals[0]"),
])
def test_a_value_with_a_nul_or_another_control_character_is_refused_naming_the_field(hyperparameters, field):
    with pytest.raises(ManifestError) as refused:
        experiment(hyperparameters)
    assert refused.value.field == field and "control character" in str(refused.value)


def test_tabs_and_line_breaks_in_a_value_are_text():
    spec = experiment('{opt: {type: categorical, vals: ["a\\tb", "x\\ny"]}}')
    assert spec.hyperparameters[0].vals == ("a\tb", "x\ny")


@pytest.mark.parametrize("value", ["x\x00", "2026-11-30T12:00:00", "2026-11-30T12:00:00+99:00", "9" * 41,
                                   "2026-11-30T12:00:00Z' OR 1=1 --", "\u0662\u0660\u0662\u0666-11-30T12:00:00Z"])
def test_an_experiment_refreshs_changed_after_is_a_time_with_its_offset_or_a_400_naming_it(value):
    """GET /api/v1/experiments/ID/?changed_after= (the page's refreshes) reads it with jobs.bounds.moment."""
    from jobs.bounds import BadParameter, moment
    with pytest.raises(BadParameter) as refused:
        moment({"changed_after": value}, "changed_after")
    assert refused.value.field == "changed_after"
