"""`from learner_agent import batch_config`: the batch sizes and learning-rate factor of an elastic attempt."""
import dataclasses

import pytest

from learner_agent import DEFAULT_GLOBAL_BATCH, BatchConfig, batch_config

VARIABLES = ("WORLD_SIZE", "RANK", "TRAINYARD_GLOBAL_BATCH_SIZE", "TRAINYARD_LOCAL_BATCH_SIZE",
             "TRAINYARD_LR_SCALE", "RESUME_FROM")


@pytest.fixture
def env(monkeypatch):
    """A clean environment for the variables batch_config reads; returns a setter."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, value)
    return set_env


def test_it_reads_what_the_platform_sets(env):
    env(WORLD_SIZE="4", RANK="3", TRAINYARD_GLOBAL_BATCH_SIZE="512", TRAINYARD_LOCAL_BATCH_SIZE="128",
        TRAINYARD_LR_SCALE="2.0", RESUME_FROM="/job/checkpoints/attempt-2/samples-4096.pt")
    assert batch_config() == BatchConfig(global_batch=512, local_batch=128, lr_scale=2.0, world_size=4, rank=3,
                                         resume_from="/job/checkpoints/attempt-2/samples-4096.pt")


def test_it_defaults_to_one_learner_a_fresh_start_and_no_scaling(env):
    assert batch_config() == BatchConfig(global_batch=DEFAULT_GLOBAL_BATCH, local_batch=DEFAULT_GLOBAL_BATCH,
                                         lr_scale=1.0, world_size=1, rank=0, resume_from=None)


def test_its_default_batch_is_the_callers_rounded_down_to_the_world_size(env):
    env(WORLD_SIZE="3", RANK="1")
    config = batch_config(default_global_batch=100)
    assert (config.global_batch, config.local_batch, config.lr_scale) == (99, 33, 1.0)


def test_its_default_batch_is_at_least_one_sample_per_learner(env):
    env(WORLD_SIZE="4")
    assert batch_config(default_global_batch=2).local_batch == 1


def test_it_derives_the_local_batch_from_the_global_one(env):
    env(WORLD_SIZE="2", TRAINYARD_GLOBAL_BATCH_SIZE="96")
    assert batch_config().local_batch == 48


def test_it_treats_an_empty_variable_as_unset(env):
    env(WORLD_SIZE="", RESUME_FROM="", TRAINYARD_LR_SCALE="")
    config = batch_config()
    assert (config.world_size, config.resume_from, config.lr_scale) == (1, None, 1.0)


def test_it_is_frozen(env):
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch_config().global_batch = 1


@pytest.mark.parametrize("values, named", [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
    ({"RANK": "x"}, "RANK"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK"),
    ({"RANK": "-1"}, "RANK"),
    ({"TRAINYARD_GLOBAL_BATCH_SIZE": "64.5"}, "TRAINYARD_GLOBAL_BATCH_SIZE"),
    ({"TRAINYARD_GLOBAL_BATCH_SIZE": "-64"}, "TRAINYARD_GLOBAL_BATCH_SIZE"),
    ({"TRAINYARD_LOCAL_BATCH_SIZE": "0"}, "TRAINYARD_LOCAL_BATCH_SIZE"),
    ({"WORLD_SIZE": "2", "TRAINYARD_GLOBAL_BATCH_SIZE": "64", "TRAINYARD_LOCAL_BATCH_SIZE": "16"},
     "TRAINYARD_LOCAL_BATCH_SIZE"),
    ({"WORLD_SIZE": "3", "TRAINYARD_GLOBAL_BATCH_SIZE": "64"}, "TRAINYARD_GLOBAL_BATCH_SIZE"),
    ({"TRAINYARD_LR_SCALE": "fast"}, "TRAINYARD_LR_SCALE"),
    ({"TRAINYARD_LR_SCALE": "0"}, "TRAINYARD_LR_SCALE"),
    ({"TRAINYARD_LR_SCALE": "nan"}, "TRAINYARD_LR_SCALE"),
    ({"TRAINYARD_LR_SCALE": "inf"}, "TRAINYARD_LR_SCALE"),
])
def test_it_refuses_a_bad_value_naming_the_variable(env, values, named):
    env(**values)
    with pytest.raises(ValueError, match=named):
        batch_config()
