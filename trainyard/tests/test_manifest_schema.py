"""The manifest's JSON Schema (`trainyard schema`, docs/manifest.schema.json) says what the parser says:
every manifest the parser accepts is valid against it, and what it can express it refuses too."""
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from trainyard import cli
from trainyard.manifest import ManifestError, json_schema, parse_manifest

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "docs" / "manifest.schema.json"
MANIFESTS = sorted((ROOT.parent / "shared" / "ffdl" / "examples").glob("*.yml")) + sorted(
    (ROOT / "examples").glob("*/manifest.yml"))
BASE = "name: x\nframework: {name: custom, command: sh run.sh}\n"


@pytest.fixture(scope="module")
def schema():
    jsonschema.Draft202012Validator.check_schema(json_schema())
    return jsonschema.Draft202012Validator(json_schema())


def test_the_published_schema_is_the_parsers():
    assert json.loads(PUBLISHED.read_text()) == json_schema(), \
        "docs/manifest.schema.json is stale: python -m trainyard schema > docs/manifest.schema.json"


def test_the_cli_prints_it(capsys):
    assert cli.main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == json_schema()


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
