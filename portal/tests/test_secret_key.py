"""The generated secret key (portal.secret_key) and how the settings choose a key."""
import multiprocessing
import os
import stat
import subprocess
import sys

import pytest

from portal import secret_key
from portal.runner import PROJECT_ROOT


def test_it_generates_a_private_key_once_and_reuses_it(tmp_path):
    key = secret_key.load_or_create(tmp_path)
    path = tmp_path / "secret_key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(key) >= 50
    assert secret_key.load_or_create(tmp_path) == key
    assert [p.name for p in tmp_path.iterdir()] == ["secret_key"]  # no temporary file left behind


def test_it_gives_each_data_directory_its_own_key(tmp_path):
    assert secret_key.load_or_create(tmp_path / "a") != secret_key.load_or_create(tmp_path / "b")


def _first_start(args):
    folder, barrier = args
    barrier.wait()
    return secret_key.load_or_create(folder)


def test_processes_starting_together_agree_on_one_key(tmp_path):
    context = multiprocessing.get_context("fork")
    for round_ in range(20):
        folder = tmp_path / f"round-{round_}"
        with context.Manager() as manager:
            barrier = manager.Barrier(6)
            with context.Pool(6) as pool:
                keys = pool.map(_first_start, [(folder, barrier)] * 6)
        assert len(set(keys)) == 1
        assert (folder / "secret_key").read_text().strip() == keys[0]


def test_it_refuses_a_key_file_others_can_read(tmp_path):
    secret_key.load_or_create(tmp_path)
    os.chmod(tmp_path / "secret_key", 0o644)
    with pytest.raises(secret_key.SecretKeyError, match="chmod 600"):
        secret_key.load_or_create(tmp_path)


def test_it_refuses_an_empty_key_file(tmp_path):
    path = tmp_path / "secret_key"
    path.write_text("\n")
    os.chmod(path, 0o600)
    with pytest.raises(secret_key.SecretKeyError, match="no usable key"):
        secret_key.load_or_create(tmp_path)


def settings_key(data_dir, **env):
    """SECRET_KEY as a fresh process's settings see it (or its error)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("TRAINYARD_SECRET_KEY", "DJANGO_SECRET_KEY",
                                                                "TRAINYARD_REQUIRE_SECRET_KEY")}
    clean.update(TRAINYARD_DATA_DIR=str(data_dir), DJANGO_SETTINGS_MODULE="portal.settings", **env)
    result = subprocess.run([sys.executable, "-c", "from django.conf import settings; print(settings.SECRET_KEY)"],
                            cwd=PROJECT_ROOT, env=clean, capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else result.stderr


def test_the_settings_use_the_generated_key(tmp_path):
    key = settings_key(tmp_path)
    assert key == (tmp_path / "secret_key").read_text().strip()
    assert settings_key(tmp_path) == key
    assert "trainyard-insecure" not in key


def test_an_explicit_key_wins(tmp_path):
    generated = settings_key(tmp_path)
    assert settings_key(tmp_path, TRAINYARD_SECRET_KEY="operator-chosen-" + "k" * 50) == "operator-chosen-" + "k" * 50
    assert settings_key(tmp_path) == generated


def test_requiring_a_key_refuses_to_generate_one(tmp_path):
    error = settings_key(tmp_path, TRAINYARD_REQUIRE_SECRET_KEY="true", TRAINYARD_DEBUG="true")
    assert "TRAINYARD_SECRET_KEY must be set" in error
    assert not (tmp_path / "secret_key").exists()


def test_credentials_sealed_before_a_restart_unseal_after_it(tmp_path):
    from jobs import datastores
    before, after = settings_key(tmp_path), settings_key(tmp_path)  # two starts on one data directory
    datastores.seal_credentials(tmp_path, {"lake": {"password": "s3cret"}}, keys=before)
    assert datastores.unseal_credentials(tmp_path, keys=after) == {"lake": {"password": "s3cret"}}
