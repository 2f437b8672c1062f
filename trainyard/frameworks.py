"""The framework registry: which frameworks Trainyard runs, and how it starts their learners.

One entry per framework says, for each backend, what a learner runs in (`local`: the platform's own
Python environment, which must be able to import `modules`; `kubernetes`: the `image`), which
versions it accepts (`versions`), and what a distributed learner needs besides the common
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (`distributed_env`). FfDL's framework names are
mapped onto these entries where there is a sensible equivalent (`FFDL_NAMES`) and refused with a
reason where there is none (`UNSUPPORTED`).

Django-free on purpose: `trainyard validate` uses it offline, exactly as the server does.

Adding a framework is one `Framework(...)` entry in `REGISTRY` (see docs/frameworks.md, "Adding a framework").
"""
import importlib.metadata
import importlib.util
import json
import re
from dataclasses import dataclass, field


class FrameworkError(ValueError):
    """A manifest's framework (or its version) is not one Trainyard runs; the message says why."""

    def __init__(self, field_name, rule):
        self.field = field_name
        self.rule = rule
        super().__init__(rule)


@dataclass(frozen=True)
class Framework:
    name: str
    title: str
    # local backend: the Python distribution whose installed version runs, and the modules a
    # learner's `python` must be able to import (checked at deploy, so a missing package is a clear
    # failure instead of an ImportError in the learner's log).
    distribution: str
    modules: tuple
    # kubernetes backend: the learner image; "{version}" is replaced by the resolved version.
    image: str
    # The version `latest` (or no version) stands for on container backends.
    default_version: str
    # Oldest accepted version (major, minor); older code needs changes Trainyard cannot make for you.
    minimum: tuple = (0, 0)
    why_minimum: str = ""
    # Extra environment of every learner on every backend (e.g. which Keras backend to use).
    env: dict = field(default_factory=dict)

    def check_version(self, version):
        """The version a manifest asked for, normalised ("" for "latest"); FrameworkError if refused."""
        version = (version or "").strip()
        if version.lower() in ("", "latest"):
            return ""
        if parse_version(version) is None:
            raise FrameworkError("framework.version", f"{version!r} is not a {self.title} version; write e.g. "
                                                      f"\"{self.default_version}\" or \"latest\"")
        return version

    def too_old(self, version):
        """Why `version` is older than what Trainyard runs, or "" when it is recent enough."""
        parsed = parse_version((version or "").strip())
        if parsed is None or parsed >= self.minimum:
            return ""
        oldest = ".".join(map(str, self.minimum))
        return f"{self.title} {oldest} or newer ({self.why_minimum})"

    def image_for(self, version):
        return self.image.format(version=version or self.default_version)

    def distributed_env(self, *, index, learners, hosts, port):
        """Framework-specific variables of learner `index` of a distributed job (beyond RANK etc.)."""
        return {}

    def installed_version(self):
        """The version installed beside the platform (what runs on `local`), or None if it is missing."""
        if not all(importlib.util.find_spec(module) for module in self.modules):
            return None
        try:
            return importlib.metadata.version(self.distribution) if self.distribution else ""
        except importlib.metadata.PackageNotFoundError:
            return None


@dataclass(frozen=True)
class TensorFlowFramework(Framework):
    """TensorFlow's MultiWorkerMirroredStrategy reads the cluster from TF_CONFIG."""

    def distributed_env(self, *, index, learners, hosts, port):
        workers = [f"{hosts[i]}:{port + 1 + i}" for i in range(learners)]
        return {"TF_CONFIG": json.dumps({"cluster": {"worker": workers},
                                         "task": {"type": "worker", "index": index}})}


@dataclass(frozen=True)
class JaxFramework(Framework):
    """jax.distributed.initialize(coordinator_address, num_processes, process_id) from these."""

    def distributed_env(self, *, index, learners, hosts, port):
        return {"JAX_COORDINATOR_ADDRESS": f"{hosts[0]}:{port}", "JAX_NUM_PROCESSES": str(learners),
                "JAX_PROCESS_ID": str(index)}


@dataclass(frozen=True)
class CustomFramework(Framework):
    """Any command. FfDL used the custom framework's `version` as the image to run: so does Trainyard."""

    def check_version(self, version):
        return (version or "").strip()

    def image_for(self, version):
        return version if looks_like_image(version) else self.image


_TF_WHY = "TensorFlow 1.x graphs and tf.contrib do not exist in 2.x"
REGISTRY = {f.name: f for f in (
    Framework(name="pytorch", title="PyTorch", distribution="torch", modules=("torch",),
              image="pytorch/pytorch:{version}", default_version="2.13", minimum=(1, 8),
              why_minimum="torch.distributed's env:// launch and the gloo backend as used here need 1.8+"),
    TensorFlowFramework(name="tensorflow", title="TensorFlow", distribution="tensorflow-cpu",
                        modules=("tensorflow",), image="tensorflow/tensorflow:{version}", default_version="2.21",
                        minimum=(2, 12), why_minimum=_TF_WHY),
    TensorFlowFramework(name="keras", title="Keras", distribution="keras", modules=("keras", "tensorflow"),
                        # TensorFlow's image ships Keras 3; its tag is TensorFlow's, not Keras's.
                        image="tensorflow/tensorflow:2.21", default_version="3.15", minimum=(3, 0),
                        why_minimum="Keras 3 is multi-backend; Keras 2 code runs with tensorflow's tf.keras "
                                    "(framework tensorflow)", env={"KERAS_BACKEND": "tensorflow"}),
    JaxFramework(name="jax", title="JAX", distribution="jax", modules=("jax",),
                 image="ghcr.io/trainyard/learner-jax:{version}", default_version="0.10", minimum=(0, 4),
                 why_minimum="jax.distributed and the jax.numpy API used today settled in 0.4"),
    Framework(name="sklearn", title="scikit-learn", distribution="scikit-learn", modules=("sklearn",),
              image="ghcr.io/trainyard/learner-sklearn:{version}", default_version="1.9", minimum=(1, 0),
              why_minimum="earlier releases lack the estimator API the examples use"),
    CustomFramework(name="custom", title="custom", distribution="", modules=(),
                    image="python:3.11-slim", default_version=""),
)}

# FfDL framework names with an equivalent here: name -> (Trainyard framework, what the mapping means).
FFDL_NAMES = {
    "pytorchmpi": ("pytorch", "FfDL's MPI-launched PyTorch runs as PyTorch learners that rendezvous through "
                              "torch.distributed env:// (use the gloo or nccl backend instead of mpi)"),
    "horovod": ("tensorflow", "Horovod jobs run as TensorFlow learners with TF_CONFIG and the torch.distributed "
                              "variables set; Horovod itself is not installed, so use "
                              "MultiWorkerMirroredStrategy or torch.distributed instead of hvd.init()"),
    "tf": ("tensorflow", "FfDL's short name for TensorFlow"),
    "scikit-learn": ("sklearn", "the package name of scikit-learn"),
}
# Names Trainyard refuses, with the reason and what to do instead.
UNSUPPORTED = {
    "caffe": "Caffe (BVLC) is unmaintained since 2017 and has no Python 3.11 build; port the model to PyTorch, "
             "or run your own image with framework custom",
    "caffe2": "Caffe2 was merged into PyTorch; use framework pytorch",
    "h2o3": "H2O-3 needs a Java cluster Trainyard does not start; run your own image with framework custom",
    "mxnet": "Apache MXNet is retired (2023); use pytorch, jax or tensorflow, or your own image with "
             "framework custom",
    "torch": "FfDL's \"torch\" is Lua Torch, which is unmaintained; use framework pytorch",
}


@dataclass(frozen=True)
class Resolved:
    """A manifest's framework after mapping: what runs, and what (if anything) was translated."""
    framework: Framework
    version: str  # normalised; "" means the backend's default / what is installed
    asked_as: str  # the name the manifest used
    notes: tuple = ()

    @property
    def name(self):
        return self.framework.name


def resolve(name, version=""):
    """Map a manifest's framework name and version to a registry entry; FrameworkError if refused."""
    asked = (name or "").strip().lower()
    notes = []
    if asked in UNSUPPORTED:
        raise FrameworkError("framework.name", f"{asked!r} is an FfDL framework Trainyard does not run: "
                                               f"{UNSUPPORTED[asked]}")
    target = asked
    if asked in FFDL_NAMES:
        target, meaning = FFDL_NAMES[asked]
        notes.append(f"framework {asked!r} runs as {target!r}: {meaning}")
    framework = REGISTRY.get(target)
    if framework is None:
        raise FrameworkError("framework.name", f"{asked!r} is not a framework Trainyard runs; use one of "
                                               f"{', '.join(names())}")
    if why := framework.too_old(version):
        # SPEC §2: every FfDL manifest parses. Their old versions (e.g. TensorFlow 1.5.0-py3) map onto
        # what Trainyard runs, and validate says so, rather than refusing the manifest outright.
        notes.append(f"version {version!r} is older than Trainyard runs: {why}; the job runs on "
                     f"{framework.title} {framework.default_version} (the installed one on the local backend), "
                     f"so code written for {version} may need porting")
        version = ""
    checked = framework.check_version(version)
    if (version or "").strip().lower() == "latest":
        notes.append(f"version \"latest\" means the installed {framework.title} on the local backend and "
                     f"{framework.image_for('')} on Kubernetes")
    if framework.name == "custom" and looks_like_image(checked):
        notes.append(f"version {checked!r} is FfDL's custom image: it runs as that image on Kubernetes; the "
                     "local backend runs the command in the platform's Python environment")
    return Resolved(framework, checked, asked, tuple(notes))


def names():
    """Every name a manifest may use: the registry's, then FfDL's mapped ones."""
    return (*REGISTRY, *FFDL_NAMES)


def parse_version(text):
    """'2.13' -> (2, 13); '1.5.0-py3' -> (1, 5); None when it does not start with a number."""
    match = re.match(r"v?(\d+)(?:\.(\d+))?", str(text).strip())
    if not match:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


def looks_like_image(text):
    """An OCI image reference such as 'tomcli/pytorch:latest' (has a '/' or a ':' tag, no spaces)."""
    return bool(text) and " " not in text and ("/" in text or ":" in text)
