from pathlib import Path

import pytest

from jobs.manifest import ManifestError, parse_manifest, parse_memory

FFDL_EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "shared" / "ffdl" / "examples").glob("*.yml"))
PROJECT_EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*/manifest.yml"))

GOOD = """
name: mnist
learners: 2
gpus: 1
cpus: 2
memory: 4GiB
framework: {name: pytorch, version: "2.13", command: python train.py}
"""


# Every FfDL example gets a verdict: accepted (with the mappings `trainyard validate` prints), or
# refused naming the field and the rule.
FFDL_VERDICTS = {
    "pytorch-model-manifest.yml": ("pytorch", ["version \"latest\"", "mount_cos is read as s3_datastore"]),
    "pytorch-launch-dist-manifest.yml": ("custom", ["'tomcli/pytorch:latest' is FfDL's custom image",
                                                    "tensorboard event files are not read"]),
    "tf-model-manifest.yml": ("tensorflow", ["version '1.5.0-py3' is older than Trainyard runs",
                                             "mount_cos is read as s3_datastore"]),
    "keras-test-manifest-py3.yml": ("tensorflow", ["version '1.5.0-py3' is older than Trainyard runs"]),
}


def test_every_ffdl_example_has_a_verdict():
    assert sorted(FFDL_VERDICTS) == sorted(p.name for p in FFDL_EXAMPLES)


@pytest.mark.parametrize("path", FFDL_EXAMPLES, ids=lambda p: p.name)
def test_it_accepts_or_refuses_each_ffdl_manifest_clearly(path):
    verdict = FFDL_VERDICTS[path.name]
    if isinstance(verdict, ManifestError):
        with pytest.raises(ManifestError) as error:
            parse_manifest(path.read_bytes())
        assert error.value.field == verdict.field and verdict.rule in error.value.rule
        return
    manifest = parse_manifest(path.read_bytes())
    framework, notes = verdict
    assert manifest.name and manifest.command and manifest.framework == framework
    for note in notes:
        assert any(note in n for n in manifest.notes), (note, manifest.notes)


@pytest.mark.parametrize("path", PROJECT_EXAMPLES, ids=lambda p: p.parent.name)
def test_it_accepts_the_bundled_examples(path):
    assert parse_manifest(path.read_bytes()).command


def test_it_parses_the_documented_fields():
    manifest = parse_manifest(GOOD)
    assert (manifest.learners, manifest.gpus, manifest.cpus, manifest.memory_bytes) == (2, 1, 2.0, 4 * 2**30)
    assert manifest.framework == "pytorch" and manifest.priority == "normal"
    assert manifest.checkpoint_signal == "SIGTERM" and manifest.grace_seconds == 60


@pytest.mark.parametrize("text, size", [("1Gb", 10**9), ("1000MiB", 1000 * 2**20), ("512MB", 512 * 10**6),
                                        ("2GB", 2 * 10**9), ("1.5GiB", int(1.5 * 2**30))])
def test_it_reads_memory_units(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize("change, field", [
    ("memory: 4XB", "memory"),
    ("memory: 4096", "memory"),
    ("gpus: -1", "gpus"),
    ("gpus: 1.5", "gpus"),
    ("cpus: zero", "cpus"),
    ("learners: 0", "learners"),
    ("priority: urgent", "priority"),
    ("framework: {name: fortran, command: x}", "framework.name"),
    ("framework: {name: pytorch}", "framework.command"),
    ("checkpoint: {signal: SIGSTOP}", "checkpoint.signal"),
    ("restart_policy: {max_retries: -2}", "restart_policy.max_retries"),
    ("data_stores: [{id: s, type: ftp}]", "data_stores[0].type"),
    ("data_stores: [{id: s, type: s3_datastore, training_data: {}}]", "data_stores[0].training_data.container"),
    ("data_stores: [{id: s, type: s3_datastore, training_data: {container: a/../b}}]",
     "data_stores[0].training_data.container"),
    ("data_stores: [{id: s, type: local, training_data: {container: /etc}}]", "data_stores[0].training_data.container"),
    ("data_stores: [{id: s, type: s3_datastore, connection: {auth_url: ftp://x}}]", "data_stores[0].connection.auth_url"),
    ("data_stores: [{id: s, type: s3_datastore, connection: {passwd: x}}]", "data_stores[0].connection.passwd"),
    ("data_stores: [{id: s, type: local, connection: {password: x}}]", "data_stores[0].connection"),
    ("data_stores: [{id: s, type: local}, {id: s, type: local}]", "data_stores[1].id"),
    ("framework: {name: caffe, command: x}", "framework.name"),
    ("framework: {name: pytorch, version: 'zero.four', command: x}", "framework.version"),
    ("framework: {name: jax, version: banana, command: x}", "framework.version"),
    ("evaluation_metrics: {type: regex_extractor, groups: {train: {regex: '(unclosed'}}}",
     "evaluation_metrics.groups.train.regex"),
    ("gpu: 1", "gpu"),
])
def test_it_names_the_field_that_breaks_a_rule(change, field):
    key = change.split(":")[0]
    lines = [line for line in GOOD.strip().splitlines() if not line.startswith(key + ":")]
    with pytest.raises(ManifestError) as error:
        parse_manifest("\n".join(lines + [change]))
    assert error.value.field == field
    assert str(error.value).startswith(field + ":")


@pytest.mark.parametrize("text, field", [("name: [unclosed", "manifest"), ("- a list", "manifest"),
                                         (b"\xff\xfe", "manifest"), ("framework: {}", "framework.name")])
def test_it_refuses_what_is_not_a_manifest(text, field):
    with pytest.raises(ManifestError) as error:
        parse_manifest(text)
    assert error.value.field == field


def test_it_requires_a_name():
    with pytest.raises(ManifestError) as error:
        parse_manifest("framework: {name: custom, command: echo hi}")
    assert error.value.field == "name"
