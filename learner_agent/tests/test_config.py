"""agent.json: what the agent accepts, and the clear error for what it doesn't."""
import pytest

from learner_agent.config import ConfigError, parse_config

MINIMAL = {"job_id": "training-abc12345", "attempt": 1, "learner": 0, "command": "python train.py",
           "code_archive": "../../code.zip", "work_dir": "work", "ingest_url": "http://127.0.0.1:8000/x/",
           "ingest_token": "t"}


def test_it_fills_defaults_and_resolves_paths_next_to_the_config():
    config = parse_config(MINIMAL, path="/s/job/attempt-1/learner-0/agent.json")
    assert config.work_dir == "/s/job/attempt-1/learner-0/work"
    assert config.code_archive == "/s/job/attempt-1/learner-0/../../code.zip"
    assert (config.sandbox, config.checkpoint_signal, config.grace_seconds, config.memory_bytes,
            config.flush_timeout_s) == ("auto", "SIGTERM", 60.0, None, 86400.0)
    assert config.agent_file("exit.json") == "/s/job/attempt-1/learner-0/exit.json"
    assert "ingest_token" not in repr(config)


@pytest.mark.parametrize("change, message", [
    ({"command": ""}, "command: required"),
    ({"attempt": 0}, "attempt: must be an integer >= 1"),
    ({"sandbox": "docker"}, "sandbox: must be one of"),
    ({"checkpoint_signal": "SIGNOPE"}, "checkpoint_signal"),
    ({"metric_regexes": {"train": "(unclosed"}}, "metric_regexes.train: not a valid regex"),
    ({"cpus": 0}, "cpus: must be > 0"),
    ({"writable_dirs": "results"}, "writable_dirs: must be a list"),
])
def test_it_refuses_what_it_does_not_understand(change, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({**MINIMAL, **change}, path="/x/agent.json")
