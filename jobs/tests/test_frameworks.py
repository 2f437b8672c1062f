"""The framework registry: names, FfDL mappings and refusals, version rules, images, distributed env."""
import json

import pytest

from trainyard import frameworks
from trainyard.frameworks import FrameworkError, resolve
from trainyard.manifest import parse_manifest


@pytest.mark.parametrize("name", ["pytorch", "tensorflow", "keras", "jax", "sklearn", "custom"])
def test_it_runs_every_documented_framework(name):
    resolved = resolve(name)
    assert resolved.name == name and resolved.version == "" and resolved.notes == ()


@pytest.mark.parametrize("ffdl, target", [("pytorchmpi", "pytorch"), ("horovod", "tensorflow"),
                                          ("TF", "tensorflow"), ("scikit-learn", "sklearn")])
def test_it_maps_ffdl_names_and_says_so(ffdl, target):
    resolved = resolve(ffdl)
    assert resolved.name == target and resolved.asked_as == ffdl.lower()
    assert resolved.notes and f"runs as {target!r}" in resolved.notes[0]


@pytest.mark.parametrize("name", ["caffe", "caffe2", "h2o3", "mxnet", "torch"])
def test_it_refuses_ffdl_frameworks_it_does_not_run_with_the_reason(name):
    with pytest.raises(FrameworkError) as error:
        resolve(name)
    assert error.value.field == "framework.name"
    assert "Trainyard does not run" in str(error.value) and frameworks.UNSUPPORTED[name] in str(error.value)


def test_an_unknown_name_lists_what_is_available():
    with pytest.raises(FrameworkError) as error:
        resolve("fortran")
    assert "pytorch" in str(error.value) and "pytorchmpi" in str(error.value)


@pytest.mark.parametrize("name, version, verdict", [
    ("pytorch", "2.13", "ok"), ("pytorch", "1.7", "mapped"), ("pytorch", "latest", "ok"),
    ("tensorflow", "2.21", "ok"), ("tensorflow", "1.5.0-py3", "mapped"), ("keras", "2.15", "mapped"),
    ("keras", "3.15", "ok"), ("jax", "0.3", "mapped"), ("jax", "0.10.2", "ok"), ("sklearn", "0.24", "mapped"),
    ("custom", "anything at all", "ok"), ("pytorch", "two", "refused"),
])
def test_version_rules(name, version, verdict):
    """Recent versions run as asked; older ones run on what Trainyard supports, saying so (FfDL
    manifests must parse); a version that is not one is refused."""
    if verdict == "refused":
        with pytest.raises(FrameworkError) as error:
            resolve(name, version)
        assert error.value.field == "framework.version" and "is not a" in str(error.value)
        return
    resolved = resolve(name, version)
    older = [n for n in resolved.notes if "is older than Trainyard runs" in n]
    assert bool(older) == (verdict == "mapped")
    if older:
        assert resolved.version == "" and "or newer" in older[0] and "may need porting" in older[0]


def test_images_follow_the_version_and_custom_takes_ffdls_image_from_the_version():
    assert resolve("pytorch", "2.5").framework.image_for("2.5") == "pytorch/pytorch:2.5"
    assert frameworks.REGISTRY["tensorflow"].image_for("") == "tensorflow/tensorflow:2.21"
    custom = resolve("custom", "tomcli/pytorch:latest")
    assert custom.framework.image_for(custom.version) == "tomcli/pytorch:latest"
    assert "custom image" in custom.notes[0]


def test_distributed_env_per_framework():
    tf = frameworks.REGISTRY["tensorflow"].distributed_env(index=1, learners=2, hosts=["a", "b"], port=3000)
    assert json.loads(tf["TF_CONFIG"]) == {"cluster": {"worker": ["a:3001", "b:3002"]},
                                           "task": {"type": "worker", "index": 1}}
    jax = frameworks.REGISTRY["jax"].distributed_env(index=1, learners=2, hosts=["a", "b"], port=3000)
    assert jax == {"JAX_COORDINATOR_ADDRESS": "a:3000", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    assert frameworks.REGISTRY["pytorch"].distributed_env(index=0, learners=2, hosts=["a", "b"], port=1) == {}


def test_the_local_python_has_pytorch_and_sklearn_installed():
    assert frameworks.REGISTRY["pytorch"].installed_version().startswith("2.")
    assert frameworks.REGISTRY["sklearn"].installed_version()
    assert frameworks.REGISTRY["custom"].installed_version() == ""


def test_a_missing_package_reads_as_not_installed():
    missing = frameworks.Framework(name="x", title="X", distribution="no-such-dist", modules=("no_such_module",),
                                   image="x", default_version="1")
    assert missing.installed_version() is None


def test_the_manifest_carries_the_resolved_framework():
    manifest = parse_manifest("name: m\nframework: {name: pytorchmpi, version: '2.13', command: python t.py}")
    assert (manifest.framework, manifest.framework_asked, manifest.framework_version) == ("pytorch", "pytorchmpi",
                                                                                           "2.13")
    assert any("torch.distributed" in note for note in manifest.notes)


def test_the_local_backend_refuses_a_framework_its_python_cannot_import(monkeypatch):
    from jobs.backends import local
    from jobs.backends.base import BackendError
    monkeypatch.setattr(local, "_installed_version", lambda name: None)
    with pytest.raises(BackendError, match="cannot import tensorflow; install it") as error:
        local._check_framework("tensorflow", "2.21")
    assert error.value.permanent


def test_the_local_backend_refuses_another_major_version_than_installed():
    from jobs.backends import local
    from jobs.backends.base import BackendError
    local._check_framework("pytorch", "2.5")  # same major: runs on the installed 2.x
    local._check_framework("pytorch", "")
    with pytest.raises(BackendError, match=r"asks for PyTorch 1.13, but the local backend runs the installed"):
        local._check_framework("pytorch", "1.13")


@pytest.mark.django_db
def test_deploy_spec_carries_the_image_and_each_learners_rendezvous():
    from jobs.lifecycle import deploy_spec
    from tests.support.builders import job, member
    row = job(member(), learners=2, framework="keras", manifest_yaml=(
        "name: k\nlearners: 2\nframework: {name: keras, version: '3.15', command: python train.py}\n"))
    spec = deploy_spec(row)
    assert spec.image == "tensorflow/tensorflow:2.21" and spec.framework == "keras"
    assert spec.env["KERAS_BACKEND"] == "tensorflow"
    first, second = (learner.env for learner in spec.learners)
    assert (first["RANK"], second["RANK"], first["WORLD_SIZE"], first["MASTER_ADDR"]) == ("0", "1", "2", "127.0.0.1")
    assert first["MASTER_PORT"] == second["MASTER_PORT"]
    assert json.loads(second["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}


@pytest.mark.django_db
def test_every_job_gets_a_uid_number_of_its_own_and_keeps_it_across_attempts():
    """The local backend's learners run as uid BASE + this number mod 2**24 (learner_agent.sandbox): a
    hash of the job's id could give two tenants' running jobs the same uid; numbers made in turn do not,
    for any 2**24 jobs in a row."""
    from jobs.lifecycle import deploy_spec
    from jobs.models import Job
    from tests.support.builders import job, member
    ours, theirs = job(member("team-a", "alice")), job(member("team-b", "bob"))
    first, other = deploy_spec(ours).uid_number, deploy_spec(theirs).uid_number
    assert first != other
    Job.objects.filter(pk=ours.pk).update(attempt=2)
    assert deploy_spec(Job.objects.get(pk=ours.pk)).uid_number == first  # its folders stay its uid's
