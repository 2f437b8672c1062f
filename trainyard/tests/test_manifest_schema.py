"""The manifests' JSON Schemas (`trainyard schema [--experiment]`, docs/*.schema.json) say what the
parsers say: every manifest a parser accepts is valid against its schema, and what a schema can
express it refuses too."""
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from trainyard import cli
from trainyard.experiment import ExperimentDocument, parse_experiment
from trainyard.manifest import ManifestError, json_schema, parse_manifest

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = {None: ROOT / "docs" / "manifest.schema.json", ExperimentDocument: ROOT / "docs" / "experiment.schema.json"}
MANIFESTS = sorted((ROOT.parent / "shared" / "ffdl" / "examples").glob("*.yml")) + sorted(
    (ROOT / "examples").glob("*/manifest.yml"))
EXPERIMENTS = sorted((ROOT / "examples").glob("*/experiment*.yml"))
BASE = "name: x\nframework: {name: custom, command: sh run.sh}\n"


@pytest.fixture(scope="module")
def schema():
    jsonschema.Draft202012Validator.check_schema(json_schema())
    return jsonschema.Draft202012Validator(json_schema())


@pytest.mark.parametrize("model, flags", [(None, []), (ExperimentDocument, ["--experiment"])])
def test_the_published_schemas_are_the_parsers_and_the_cli_prints_them(capsys, model, flags):
    assert json.loads(PUBLISHED[model].read_text()) == json_schema(model), \
        f"{PUBLISHED[model].name} is stale: python -m trainyard schema {' '.join(flags)} > docs/{PUBLISHED[model].name}"
    assert cli.main(["schema", *flags]) == 0
    assert json.loads(capsys.readouterr().out) == json_schema(model)


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.parent.name + "/" + p.name)
def test_every_experiment_example_is_valid_against_its_schema(path):
    parse_experiment(path.read_bytes())
    schema = json_schema(ExperimentDocument)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert not list(jsonschema.Draft202012Validator(schema).iter_errors(yaml.safe_load(path.read_text())))
    unknown = {**yaml.safe_load(path.read_text()), "searcher": {"name": "grid", "metric": "acc", "seeed": 1}}
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(unknown))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.parent.name + "/" + p.name)
def test_every_manifest_the_parser_accepts_is_valid_against_it(schema, path):
    parse_manifest(path.read_bytes())
    assert not list(schema.iter_errors(yaml.safe_load(path.read_text())))


@pytest.mark.parametrize("extra", [
    "", "checkpoint: null\nelastic: null\n", "memory: 512Mi\ncpus: 0.5\npriority: high\n",
    "learners: 2\nelastic: {min_learners: 1, max_learners: 4, batch_size: {global: 64, min: 32, max: 256}}\n",
    "disk: {results: 1GiB, log_lines: 1000}\n",
    "data_stores: [{id: d, type: s3_datastore, training_data: {container: bucket/prefix}, "
    "connection: {auth_url: 'http://s3:9000', user_name: u, password: 5}}]\n",
    "evaluation_metrics: {type: tensorboard, in: logs/tb, line_lookahead: 4}\n",
])
def test_a_valid_manifest_is_valid_against_it(schema, extra):
    parse_manifest(BASE + extra)
    assert not list(schema.iter_errors(yaml.safe_load(BASE + extra)))


@pytest.mark.parametrize("extra", ["gpu: 1\n", "learners: 0\n", "gpus: 1.5\n", "priority: urgent\n",
                                   "memory: 4XB\n", "checkpoint: {signal: SIGSTOP}\n", "disk: {results: lots}\n",
                                   "elastic: {min_learners: 1}\n", "framework: {name: pytorch}\n"])
def test_what_it_can_say_it_refuses_as_the_parser_does(schema, extra):
    text = BASE.replace("framework: {name: custom, command: sh run.sh}\n", "") if extra.startswith("framework") \
        else BASE
    with pytest.raises(ManifestError):
        parse_manifest(text + extra)
    assert list(schema.iter_errors(yaml.safe_load(text + extra)))
