import pytest

from portal import env


@pytest.mark.parametrize("reader, value, message", [
    (lambda: env.boolean("X_FLAG"), "maybe", "X_FLAG='maybe' is not a boolean"),
    (lambda: env.integer("X_FLAG", 1), "2.5", "X_FLAG='2.5' is not an integer"),
    (lambda: env.integer("X_FLAG", 1, minimum=1), "0", "X_FLAG='0' must be at least 1"),
    (lambda: env.number("X_FLAG", 1.0), "fast", "X_FLAG='fast' is not a number"),
    (lambda: env.choice("X_FLAG", "local", ("local", "kubernetes")), "k8s", "X_FLAG='k8s' is not one of"),
    (lambda: env.url("X_FLAG", "redis://x", schemes=("redis",)), "localhost:6379", "X_FLAG='localhost:6379' must be a URL starting with"),
    (lambda: env.log_level("X_FLAG", "INFO"), "LOUD", "X_FLAG='LOUD' is not a log level; use one of: DEBUG, INFO,"),
])
def test_it_names_the_variable_and_the_problem(monkeypatch, reader, value, message):
    monkeypatch.setenv("X_FLAG", value)
    with pytest.raises(env.ConfigError) as error:
        reader()
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("value, expected", [("yes", True), ("0", False), ("", False), ("ON", True)])
def test_it_reads_booleans(monkeypatch, value, expected):
    monkeypatch.setenv("X_FLAG", value)
    assert env.boolean("X_FLAG") is expected


@pytest.mark.parametrize("value, expected", [("debug", "DEBUG"), (" Warning ", "WARNING"), ("", "INFO")])
def test_it_reads_log_levels_in_any_case(monkeypatch, value, expected):
    monkeypatch.setenv("X_FLAG", value)
    assert env.log_level("X_FLAG", "INFO") == expected


@pytest.mark.parametrize("name, value, message", [
    ("TRAINYARD_BACKEND", "slurm", "TRAINYARD_BACKEND='slurm' is not one of: local, kubernetes"),
    ("TRAINYARD_LOG_LEVEL", "LOUD", "TRAINYARD_LOG_LEVEL='LOUD' is not a log level; use one of: DEBUG, INFO, WARNING, "
                                    "ERROR, CRITICAL"),
])
def test_a_bad_variable_stops_django_with_its_name(tmp_path, name, value, message):
    import subprocess
    import sys
    from portal.runner import PROJECT_ROOT
    result = subprocess.run([sys.executable, "manage.py", "check"], capture_output=True, text=True, cwd=PROJECT_ROOT,
                            env={"PATH": "/usr/bin:/bin", name: value, "TRAINYARD_DATA_DIR": str(tmp_path)})
    assert result.returncode != 0
    assert message in result.stderr
