from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.bombs import billion_laughs
from trainyard.manifest import ManifestError, parse_fields, parse_manifest

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
                                                    "tensorboard scalar summaries are read from "
                                                    "$JOB_STATE_DIR/logs/tb/test"]),
    "tf-model-manifest.yml": ("tensorflow", ["version '1.5.0-py3' is older than Trainyard runs",
                                             "mount_cos is read as s3_datastore",
                                             "tensorboard scalar summaries are read from $JOB_STATE_DIR/logs/tb "]),
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
                                        ("2GB", 2 * 10**9), ("1.5GiB", int(1.5 * 2**30)), ("2G", 2 * 10**9),
                                        ("2Gi", 2 * 2**30), ("512M", 512 * 10**6), ("512Mi", 512 * 2**20),
                                        ("1T", 10**12), ("1Ti", 2**40), ("1TB", 10**12), ("1TiB", 2**40)])
def test_it_reads_memory_units(text, size):
    assert memory_of(text) == size


@pytest.mark.parametrize("text", ["2g", "2", "2 lots", "2KiB", "GiB"])
def test_it_refuses_a_size_without_a_known_unit_saying_which_are(text):
    with pytest.raises(ManifestError, match="MiB, GiB, TiB .or Mi, Gi, Ti."):
        memory_of(text)


def memory_of(text):
    return parse_fields({"name": "m", "framework": {"name": "pytorch", "command": "python t.py"},
                         "memory": text}).memory_bytes


def test_it_names_every_field_that_breaks_a_rule_at_once():
    with pytest.raises(ManifestError) as error:
        parse_manifest("name: x\ngpu: 1\nlearners: 0\nmemory: 4XB\npriority: urgent\n"
                       "framework: {name: pytorch, comand: python t.py}\ncheckpoint: {signal: SIGSTOP}\n")
    fields = [problem.field for problem in error.value.problems]
    assert fields == ["gpu", "learners", "memory", "priority", "framework.command", "framework.comand",
                      "checkpoint.signal"]  # in the order the manifest names them
    assert error.value.field == "gpu"  # the first, for callers that show one
    assert str(error.value).startswith("7 problems: gpu: unknown field")


def test_one_broken_rule_reads_as_before():
    with pytest.raises(ManifestError) as error:
        parse_manifest(GOOD.replace("learners: 2", "learners: 0"))
    assert [p.field for p in error.value.problems] == ["learners"]
    assert str(error.value) == "learners: 0 is outside 1..64"


def test_a_check_that_needs_a_broken_field_is_skipped_not_reported_twice():
    # The elastic bounds are checked against `learners`; a wrong `learners` is the one problem.
    with pytest.raises(ManifestError) as error:
        parse_manifest(BASE + "learners: many\nelastic: {min_learners: 1, max_learners: 4}\n")
    assert [p.field for p in error.value.problems] == ["learners"]


@pytest.mark.parametrize("line, field, says", [
    ("gpu: 1", "gpu", "did you mean 'gpus'?"),
    ("lerners: 2", "lerners", "did you mean 'learners'?"),
    ("framework: {name: custom, command: x, comand: y}", "framework.comand", "did you mean 'command'?"),
    ("priority: hihg", "priority", "did you mean 'high'?"),
    ("checkpoint: {signal: sigterm}", "checkpoint.signal", "did you mean 'SIGTERM'?"),
])
def test_it_suggests_the_name_a_typo_meant(line, field, says):
    text = BASE.replace("framework: {name: custom, command: sh run.sh}\n", "") if line.startswith("framework") else BASE
    error = _refusal(text + line + "\n")
    assert error.field == field and error.rule.endswith(says), error.rule


def test_an_unknown_field_far_from_any_lists_the_known_ones():
    error = _refusal(BASE + "zzzqqq: 1\n")
    assert "did you mean" not in error.rule and "known fields are name, description" in error.rule


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
    ("data_stores: [{id: s, type: s3_datastore, connection: {auth_url: ftp://x}}]",
     "data_stores[0].connection.auth_url"),
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


# Hostile manifests (issue 12, finding 9): each is refused with a ManifestError naming where, never an
# exception of another kind (a 500 on the API), and never stored blown up.
BASE = "name: x\nframework: {name: custom, command: sh run.sh}\n"


def _refusal(text):
    with pytest.raises(ManifestError) as error:
        parse_manifest(text)
    return error.value


@pytest.mark.parametrize("line, field, says", [
    ("memory: " + "9" * 400 + "GiB", "memory", "outside 1MB..16384GiB"),
    ("memory: 10000000000000000000000000GiB", "memory", "outside 1MB..16384GiB"),
    ("memory: 1e25GiB", "memory", "not a memory size"),
    ("memory: 0.0000001MB", "memory", "outside 1MB..16384GiB"),
    ("memory: -4GiB", "memory", "not a memory size"),
    ("memory: [4, GiB]", "memory", "not a memory size"),
    ("cpus: .nan", "cpus", "from 0.001 to 1024"),
    ("cpus: .inf", "cpus", "from 0.001 to 1024"),
    ("cpus: -.inf", "cpus", "from 0.001 to 1024"),
    ("cpus: -1", "cpus", "from 0.001 to 1024"),
    ("cpus: 1.0e+400", "cpus", "from 0.001 to 1024"),
    ("cpus: 0.0004", "cpus", "from 0.001 to 1024"),  # a Kubernetes request of 0m: no limit at all
    ("gpus: " + "9" * 400, "gpus", "outside 0..64"),
    ("gpus: .nan", "gpus", "not a whole number in 0..64"),
    ("learners: -3", "learners", "outside 1..64"),
    ("learners: 1_000_000_000_000_000_000", "learners", "outside 1..64"),
    ("checkpoint: {grace_seconds: .inf}", "checkpoint.grace_seconds", "0..3600"),
    ("checkpoint: {grace_seconds: -1}", "checkpoint.grace_seconds", "outside 0..3600"),
    ("restart_policy: {max_retries: 100000000000000000000}", "restart_policy.max_retries", "outside 0..100"),
    ("gpus: " + "9" * 5000, "manifest", "number longer than 1000 characters"),
])
def test_it_bounds_every_number_naming_the_field_and_range(line, field, says):
    error = _refusal(BASE + line + "\n")
    assert error.field == field and says in error.rule, str(error)
    assert len(str(error)) < 300  # a 400-digit value is not echoed back whole


@pytest.mark.parametrize("line, field", [
    ("framework: {name: custom, command: x, image_location: {size: .nan}}", "framework.image_location.size"),
    ("framework: {name: custom, command: x, image_location: {size: " + "9" * 30 + "}}",
     "framework.image_location.size"),
    ("framework: {name: custom, command: x, image_tag: 2018-01-01}", "framework.image_tag"),
    ("framework: {name: custom, command: x, image_tag: !!binary aGVsbG8=}", "framework.image_tag"),
    ("framework: {name: custom, command: x, image_tag: !!set {a, b}}", "framework.image_tag"),
    ("framework: {name: custom, command: x, image_location: {[1, 2]: x}}", "manifest"),
    ("version: 2001-02-30", "manifest"),
])
def test_it_keeps_only_json_safe_values_anywhere(line, field):
    text = BASE.replace("framework: {name: custom, command: sh run.sh}\n", "") if line.startswith("framework") else BASE
    assert _refusal(text + line + "\n").field == field


def test_it_refuses_an_alias_bomb_before_expanding_it():
    bomb = billion_laughs()
    assert len(bomb) < 1000
    hidden = BASE.replace("sh run.sh}", "sh run.sh, image_location: {payload: *lol9}}")
    for text in (bomb + BASE, "evaluation_metrics:\n  in: x\n" + "".join("  " + line + "\n" for line in
                                                                        bomb.splitlines()) + hidden):
        error = _refusal(text)
        assert error.field == "manifest" and "anchor or alias" in error.rule


def test_it_refuses_anchors_and_merge_keys():
    assert "anchor" in _refusal(BASE + "checkpoint: &c {signal: SIGTERM}\n").rule
    assert "alias" in _refusal("name: &n x\ndescription: *n\nframework: {name: custom, command: x}\n").rule


@pytest.mark.parametrize("nested", [
    "[" * 20000 + "]" * 20000,
    "{a: " * 10000 + "1" + "}" * 10000,  # as deep as fits in 64 KiB
    "\n" + "- " * 20000 + "x",
    "\n" + "".join(" " * i + f"k{i}:\n" for i in range(60)) + " " * 60 + "v",
], ids=["flow-sequences", "flow-mappings", "block-sequences", "block-mappings"])
def test_it_bounds_nesting_before_recursing(nested):
    error = _refusal(BASE + "description: " + nested + "\n")
    assert error.field == "manifest" and "nests deeper than 20 levels" in error.rule


def test_it_accepts_nesting_as_deep_as_a_real_manifest_needs():
    groups = ("evaluation_metrics:\n  type: regex_extractor\n  groups:\n    train:\n"
              "      regex: 'loss (?P<loss>[\\d.]+)'\n      meta: {time: {unit: [s]}}\n")
    assert parse_manifest(BASE + groups).metric_regexes == {"train": "loss (?P<loss>[\\d.]+)"}


@pytest.mark.parametrize("text", [BASE + "description: " + "a" * 70_000 + "\n",
                                  (BASE + "description: " + "a" * 70_000 + "\n").encode()],
                         ids=["text", "bytes"])
def test_it_bounds_the_manifest_size(text):
    error = _refusal(text)
    assert error.field == "manifest" and "larger than 64 KiB" in error.rule


@pytest.mark.parametrize("line, field", [
    ("framework: {name: custom, command: x, comand: y}", "framework.comand"),
    ("checkpoint: {signal: SIGTERM, grace: 5}", "checkpoint.grace"),
    ("restart_policy: {retries: 2}", "restart_policy.retries"),
    ("data_stores: [{id: s, type: local, traning_data: {container: a}}]", "data_stores[0].traning_data"),
    ("data_stores: [{id: s, type: local, training_data: {container: a, bucket: b}}]",
     "data_stores[0].training_data.bucket"),
    ("evaluation_metrics: {type: tensorboard, directory: x}", "evaluation_metrics.directory"),
    # pydantic's own marker for a dict's key, written as a key: still the user's unknown field
    ("'[key]': 1", "[key]"),
    ("framework: {name: custom, command: x, '[key]': y}", "framework.[key]"),
])
def test_it_names_unknown_keys_in_every_section(line, field):
    text = BASE.replace("framework: {name: custom, command: sh run.sh}\n", "") if line.startswith("framework") else BASE
    error = _refusal(text + line + "\n")
    assert error.field == field and "unknown field" in error.rule


@pytest.mark.parametrize("path", FFDL_EXAMPLES, ids=lambda p: p.name)
def test_it_no_longer_says_tensorboard_metrics_are_not_read(path):
    assert not any("not read;" in note or "evaluation_metrics.in" in note
                   for note in parse_manifest(path.read_bytes()).notes)


@pytest.mark.parametrize("folder, expected", [
    (None, "$LOG_DIR/tb"), ("$JOB_STATE_DIR/logs/tb", "$JOB_STATE_DIR/logs/tb"), ("${LOG_DIR}/tb", "${LOG_DIR}/tb"),
    ("logs/tb", "logs/tb")])
def test_it_reads_tensorboard_from_the_folder_the_manifest_names(folder, expected):
    line = "evaluation_metrics: {type: tensorboard" + (f", in: '{folder}'" if folder else "") + "}\n"
    assert parse_manifest(BASE + line).tensorboard_dir == expected
    assert parse_manifest(GOOD).tensorboard_dir == ""


@pytest.mark.parametrize("folder, rule", [
    ("/etc", "absolute path"), ("$HOME/tb", "starts with $HOME"), ("$LOG_DIR/../../other", "'..'"),
    ("logs/$X", "further variables")])
def test_it_refuses_a_tensorboard_folder_outside_the_learners_own(folder, rule):
    error = _refusal(BASE + f"evaluation_metrics: {{type: tensorboard, in: '{folder}'}}\n")
    assert error.field == "evaluation_metrics.in" and rule in error.rule


def test_it_notes_the_ffdl_keys_it_ignores():
    manifest = parse_manifest(BASE.replace("sh run.sh}", "sh run.sh, image_tag: abc}")
                              + "evaluation_metrics: {type: tensorboard, in: logs/tb, line_lookahead: 4}\n")
    assert "framework.image_tag is an FfDL field Trainyard ignores" in manifest.notes
    assert "evaluation_metrics.line_lookahead is an FfDL field Trainyard ignores" in manifest.notes


def test_it_never_lets_a_recursion_error_escape_at_a_low_recursion_limit():
    import sys
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # a deep stack already in use (e.g. a web server's) must not matter
    try:
        assert _refusal(BASE + "description: " + "[" * 5000 + "]" * 5000 + "\n").field == "manifest"
    finally:
        sys.setrecursionlimit(limit)


# --- elastic block -------------------------------------------------------------------------------
ELASTIC = GOOD + "elastic: {min_learners: 1, max_learners: 4, batch_size: {global: 64, min: 32, max: 256}}\n"


def test_it_reads_an_elastic_block_with_its_defaults():
    elastic = parse_manifest(ELASTIC).elastic
    assert (elastic.min_learners, elastic.max_learners, elastic.lr_scaling) == (1, 4, "linear")
    assert (elastic.batch.base, elastic.batch.low, elastic.batch.high) == (64, 32, 256)
    assert parse_manifest(GOOD).elastic is None  # a manifest without the block: a fixed job, as before


def test_it_reads_an_elastic_block_without_batch_bounds():
    elastic = parse_manifest(GOOD + "elastic: {min_learners: 2, max_learners: 2, lr_scaling: none}\n").elastic
    assert elastic.batch is None and elastic.lr_scaling == "none"


@pytest.mark.parametrize("block, field, says", [
    ("{min_learners: 3, max_learners: 2}", "elastic.max_learners", "below elastic.min_learners"),
    ("{min_learners: 0, max_learners: 2}", "elastic.min_learners", "outside 1..64"),
    ("{min_learners: 1, max_learners: 65}", "elastic.max_learners", "outside 1..64"),
    ("{max_learners: 4}", "elastic.min_learners", "is required"),
    ("{min_learners: 1}", "elastic.max_learners", "is required"),
    ("{min_learners: 3, max_learners: 4}", "learners", "outside the elastic bounds 3..4"),  # GOOD starts at 2
    ("{min_learners: 1, max_learners: 1}", "learners", "outside the elastic bounds 1..1"),
    ("{min_learners: 1, max_learners: 4, batch_size: {global: 6, min: 5, max: 7}}", "elastic.batch_size",
     "no multiple of 4 learners lies in 5..7"),
    ("{min_learners: 2, max_learners: 3, batch_size: {global: 5, min: 5, max: 5}}", "elastic.batch_size",
     "no multiple of 2 learners"),
    ("{min_learners: 1, max_learners: 4, batch_size: {global: 512, min: 32, max: 256}}",
     "elastic.batch_size.global", "outside batch_size.min..max"),
    ("{min_learners: 1, max_learners: 4, batch_size: {global: 64, min: 128, max: 32}}",
     "elastic.batch_size.max", "below batch_size.min"),
    ("{min_learners: 1, max_learners: 4, batch_size: {global: 64, min: 32}}", "elastic.batch_size.max",
     "is required"),
    ("{min_learners: 1, max_learners: 4, batch_size: {global: 0, min: 0, max: 32}}", "elastic.batch_size.global",
     "outside"),
    ("{min_learners: 1, max_learners: 4, batch_size: 64}", "elastic.batch_size", "must be a mapping"),
    ("{min_learners: 1, max_learners: 4, lr_scaling: cubic}", "elastic.lr_scaling", "not one of linear, sqrt, none"),
    ("{min_learners: 1, max_learners: 4, max_batch: 9}", "elastic.max_batch", "unknown field"),
    ("{min_learners: 1, max_learners: 4, batch_size: {global: 64, min: 32, max: 256, local: 8}}",
     "elastic.batch_size.local", "unknown field"),
    ("[1, 4]", "elastic", "must be a mapping"),
])
def test_it_refuses_a_bad_elastic_block_naming_the_field(block, field, says):
    with pytest.raises(ManifestError) as error:
        parse_manifest(GOOD + f"elastic: {block}\n")
    assert error.value.field == field and says in error.value.rule, str(error.value)


# --- any input at all ---------------------------------------------------------------------------
_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.sampled_from(
    ["pytorch", "custom", "4GiB", "local", "s3_datastore", "tensorboard", "regex_extractor", "SIGTERM", "(?P<a>x)"])
_KEYS = st.sampled_from(["name", "framework", "command", "learners", "elastic", "min_learners", "max_learners",
                         "batch_size", "global", "min", "max", "data_stores", "id", "type", "training_data",
                         "container", "connection", "password", "evaluation_metrics", "groups", "regex", "in",
                         "disk", "results", "checkpoint", "signal", "memory", "gpu"]) | st.text(max_size=5)
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=4),
                       max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(fields=st.dictionaries(_KEYS, _VALUES, max_size=8), framework=st.dictionaries(_KEYS, _VALUES, max_size=4))
def test_any_fields_give_a_manifest_or_manifest_errors_naming_where(fields, framework):
    for data in (fields, {**fields, "name": "x", "framework": {"name": "custom", "command": "x", **framework}}):
        try:
            parse_fields(data)
        except ManifestError as error:
            assert all(problem.field and problem.rule for problem in error.problems), error.problems
