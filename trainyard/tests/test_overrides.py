"""`--set KEY=VALUE` and `--name`: reading each override, setting it on a manifest's fields, and the
manifest's own rules naming a path that is no field."""
import pytest
import yaml

from trainyard import overrides
from trainyard.manifest import ManifestError, parse_manifest

MANIFEST = """# a comment
name: demo
learners: 1
framework: {name: custom, command: sh run.sh}
data_stores:
  - id: lake
    type: local
    training_data: {container: inputs}
"""


def with_overrides(*texts, name=None, manifest=MANIFEST):
    return parse_manifest(overrides.overridden(manifest, overrides.pairs(list(texts), name=name)))


@pytest.mark.parametrize("text, expected", [
    ("gpus=2", ("gpus", 2)),
    ("cpus=0.5", ("cpus", 0.5)),
    ("optimizer.lr=1e-4", ("optimizer.lr", 1e-4)),
    ("debug=true", ("debug", True)),
    ("description=null", ("description", None)),
    ("version='2'", ("version", "2")),
    ('version="1.0"', ("version", "1.0")),
    ("version=1.0", ("version", 1.0)),
    ("description=", ("description", "")),
    ("framework.command=python train.py --lr 0.01", ("framework.command", "python train.py --lr 0.01")),
    ("framework.command=echo a: b # not a comment", ("framework.command", "echo a: b # not a comment")),
    ("framework.command=echo x=1", ("framework.command", "echo x=1")),
    ("tags=[a, b]", ("tags", "[a, b]")),
    ("memory=4GiB", ("memory", "4GiB")),
    (" learners = 2 ", ("learners", 2)),
    ("data_stores.0.id=store", ("data_stores.0.id", "store")),
])
def test_it_reads_a_value_as_a_yaml_scalar_and_anything_else_as_text(text, expected):
    assert overrides.parse(text) == expected


@pytest.mark.parametrize("text", ["gpus", "=2", "framework..command=x", ".gpus=1", "gpus.=1", "my field=1"])
def test_it_refuses_what_is_not_key_equals_value(text):
    with pytest.raises(ManifestError, match="is not KEY=VALUE with KEY a field's dotted path") as error:
        overrides.parse(text)
    assert error.value.field == "--set"


def test_it_sets_fields_at_the_top_and_in_sections():
    manifest = with_overrides("learners=2", "gpus=1", "framework.command=python train.py --lr 0.01",
                              "checkpoint.grace_seconds=5", "memory=3GiB")
    assert (manifest.learners, manifest.gpus, manifest.memory_bytes) == (2, 1, 3 * 2**30)
    assert manifest.command == "python train.py --lr 0.01" and manifest.grace_seconds == 5
    assert manifest.framework == "custom"  # the rest of the section is kept


def test_a_later_override_wins_and_name_is_set_last():
    manifest = with_overrides("learners=2", "learners=3", "name=from-set", name="from-name")
    assert manifest.learners == 3 and manifest.name == "from-name"


def test_name_is_always_text():
    assert with_overrides(name="2024").name == "2024"


def test_it_sets_a_list_item_by_its_index():
    manifest = with_overrides("data_stores.0.training_data.container=other")
    assert manifest.data_stores[0]["training_data"]["container"] == "other"


def test_it_fills_in_a_field_the_file_lacks():
    manifest = with_overrides("framework.command=sh go.sh", manifest="name: x\nframework: {name: custom}\n")
    assert manifest.command == "sh go.sh"


@pytest.mark.parametrize("text, field, rule", [
    ("gpu=2", "gpu", "unknown field; did you mean 'gpus'?"),
    ("framework.comand=x", "framework.comand", "unknown field; did you mean 'command'?"),
    ("resources.gpus=2", "resources", "unknown field"),
    ("gpus=two", "gpus", "'two' is not a whole number in 0..64"),
    ("learners=0", "learners", "0 is outside 1..64"),
    ("priority=urgent", "priority", "'urgent'"),
])
def test_the_manifests_rules_name_an_override_they_refuse(text, field, rule):
    with pytest.raises(ManifestError) as error:
        with_overrides(text)
    assert error.value.field == field and rule in error.value.rule


@pytest.mark.parametrize("text, message", [
    ("name.first=x", "name.first: name is 'demo', not a section with fields"),
    ("framework.command.line=x", "framework.command.line: framework.command is 'sh run.sh', not a section"),
    ("data_stores.id=x", "data_stores.id: data_stores is a list; name an item by its index (data_stores.0.id)"),
    ("data_stores.3.id=x", "data_stores.3.id: data_stores has 1 item; 3 is past its end"),
])
def test_a_path_through_a_value_is_refused_naming_it(text, message):
    with pytest.raises(ManifestError) as error:
        with_overrides(text)
    assert str(error.value).startswith(message)


def test_overrides_keep_the_file_as_it_is_when_there_are_none():
    assert overrides.overridden(MANIFEST, []) == MANIFEST.encode()


def test_an_overridden_manifest_is_yaml_of_the_same_fields_in_their_order():
    text = overrides.overridden(MANIFEST, [("learners", 4)]).decode()
    assert list(yaml.safe_load(text)) == ["name", "learners", "framework", "data_stores"]
    assert yaml.safe_load(text)["learners"] == 4 and "# a comment" not in text


def test_the_file_is_not_changed_in_place():
    fields = {"framework": {"command": "a"}}
    assert overrides.apply(fields, [("framework.command", "b")]) == {"framework": {"command": "b"}}
    assert fields == {"framework": {"command": "a"}}


def test_a_mapping_of_overrides_is_taken_as_given():
    assert overrides.pairs({"gpus": "2", "learners": 2}, name="n") == [("gpus", "2"), ("learners", 2), ("name", "n")]


def test_a_broken_file_is_still_named_as_the_manifest():
    with pytest.raises(ManifestError) as error:
        overrides.overridden("name: [x\n", [("gpus", 1)])
    assert error.value.field == "manifest" and "is not valid YAML" in error.value.rule
