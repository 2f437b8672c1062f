"""The agent as the Kubernetes backend runs it: config on a read-only mount (a ConfigMap), the ingest
token in a file (the attempt's Secret), its own files in `state_dir`, and halt asked for through the
pod's annotations file (a downward-API volume) since nothing can send it a signal."""
import contextlib
import json
import os
import subprocess
import time

import pytest

from learner_agent.config import ConfigError, load_config
from tests.support.agent_runs import TOKEN, agent_command, agent_env, stop_process, wait_for, write_agent_config


def kubernetes_layout(base, ingest, *, command, **overrides):
    """agent.json in a read-only folder; token, state and annotations files where the pod has them."""
    learner_config = write_agent_config(base, ingest, command=command, **overrides)
    state_dir = os.path.dirname(learner_config)
    with open(learner_config) as f:
        config = json.load(f)
    os.unlink(learner_config)
    mounts = {name: os.path.join(base, name) for name in ("agent", "ingest", "podinfo")}
    for path in mounts.values():
        os.makedirs(path)
    token_file = os.path.join(mounts["ingest"], "token")
    with open(token_file, "w") as f:
        f.write(TOKEN + "\n")
    halt_file = os.path.join(mounts["podinfo"], "annotations")
    with open(halt_file, "w") as f:
        f.write('trainyard.io/other="x"\n')
    del config["ingest_token"]
    config.update(ingest_token_file=token_file, state_dir=state_dir, halt_file=halt_file)
    path = os.path.join(mounts["agent"], "agent.json")
    with open(path, "w") as f:
        json.dump(config, f)
    os.chmod(mounts["agent"], 0o555)  # as read-only as a ConfigMap volume
    return path, state_dir, halt_file


@contextlib.contextmanager
def halted_through_annotations(config, ingest, halt_file):
    """Start the agent, and once its learner says "ready", annotate the pod for a halt as the kubelet
    would once the backend has (jobs.backends.k8s); yields the running agent process. On the way
    out the agent is stopped and the config folder made writable again (for tmp's cleanup)."""
    agent = None
    try:
        agent = subprocess.Popen(agent_command(config), env=agent_env(), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        wait_for(lambda: any(r.get("line") == "ready" for r in ingest.stored()))
        with open(halt_file, "a") as f:
            f.write('trainyard.io/halt="2026-11-21T12:00:00+00:00"\n')
        yield agent
    finally:
        if agent is not None:
            stop_process(agent)
        os.chmod(os.path.dirname(config), 0o755)


def test_it_halts_when_the_pods_annotations_ask_for_it(outside_tmp, ingest):
    command = "trap 'echo saving checkpoint; exit 0' USR2; echo ready; while :; do sleep 0.1; done"
    config, state_dir, halt_file = kubernetes_layout(outside_tmp, ingest, command=command,
                                                     checkpoint_signal="SIGUSR2", grace_seconds=10)
    with halted_through_annotations(config, ingest, halt_file) as agent:
        assert agent.wait(timeout=15) == 0
    with open(os.path.join(state_dir, "exit.json")) as f:
        assert json.load(f)["reason"] == "halted"
    assert "saving checkpoint" in [r.get("line") for r in ingest.stored()]
    assert os.listdir(os.path.dirname(config)) == ["agent.json"]  # nothing written beside the config
    assert {"agent.log", "agent.pid", "exit.json"} <= set(os.listdir(state_dir))


def test_a_learner_that_ignores_the_annotation_halt_is_killed_after_its_grace_period(outside_tmp, ingest):
    # A resize on Kubernetes asks for the checkpoint this way too (jobs.lifecycle.resize → halt_learners).
    command = "trap '' USR2; echo ready; while :; do sleep 0.1; done"
    config, state_dir, halt_file = kubernetes_layout(outside_tmp, ingest, command=command,
                                                     checkpoint_signal="SIGUSR2", grace_seconds=1)
    with halted_through_annotations(config, ingest, halt_file) as agent:
        started = time.monotonic()
        assert agent.wait(timeout=15) == 0  # the agent itself works: the pod succeeds
        assert 1 <= time.monotonic() - started < 6  # the file is polled each second, then the grace
    with open(os.path.join(state_dir, "exit.json")) as f:
        record = json.load(f)
    assert (record["exit_code"], record["reason"]) == (137, "halted: grace period expired, killed")
    exited = [r for r in ingest.stored() if r.get("kind") == "status" and r.get("state") == "exited"]
    assert [(r["exit_code"], r["reason"]) for r in exited] == [(137, "halted: grace period expired, killed")]


def test_the_learner_finds_no_credential_where_the_agent_read_it(outside_tmp, ingest):
    token_file = os.path.join(outside_tmp, "ingest", "token")
    command = (f"cat {token_file} 2>/dev/null || echo 'no credential file'; "
               "grep -c test-token /proc/$PPID/cmdline /proc/self/environ || true")
    config, state_dir, _ = kubernetes_layout(outside_tmp, ingest, command=command)
    agent = subprocess.run(agent_command(config), env=agent_env(), capture_output=True, timeout=60)
    assert agent.returncode == 0, agent.stderr
    lines = [r.get("line") for r in ingest.stored() if r.get("kind") == "log"]
    assert "no credential file" in lines
    assert not any(TOKEN in (line or "") for line in lines), lines
    assert not os.path.exists(token_file)


def test_it_reads_the_ingest_token_from_a_file(outside_tmp, ingest):
    config, _, _ = kubernetes_layout(outside_tmp, ingest, command="true")
    assert load_config(config).ingest_token == TOKEN


@pytest.mark.parametrize("change, complaint", [
    ({"ingest_token": TOKEN}, "exactly one is required"),  # both
    ({"ingest_token_file": None}, "exactly one is required"),  # neither
    ({"ingest_token_file": "/nonexistent/token"}, "cannot read /nonexistent/token"),
    ({"state_dir": 7}, "state_dir: must be a path"),
])
def test_it_refuses_a_bad_token_or_state_setting(outside_tmp, ingest, change, complaint):
    config, _, _ = kubernetes_layout(outside_tmp, ingest, command="true")
    with open(config) as f:
        data = json.load(f)
    data.update(change)
    data = {k: v for k, v in data.items() if v is not None}
    patched = os.path.join(outside_tmp, "patched.json")
    with open(patched, "w") as f:
        json.dump(data, f)
    with pytest.raises(ConfigError, match=complaint):
        load_config(patched)


def test_it_samples_its_learners_cpu_and_memory_in_a_pod(outside_tmp, ingest):
    # The Kubernetes backend asks for samples as the local one does (K8sConfig.resource_sample_s).
    command = "python3 -c 'import time; end = time.time() + 2\nwhile time.time() < end: pass'"
    config, _, _ = kubernetes_layout(outside_tmp, ingest, command=command, resource_sample_s=0.25)
    try:
        agent = subprocess.run(agent_command(config), env=agent_env(), capture_output=True, timeout=60)
    finally:
        os.chmod(os.path.dirname(config), 0o755)
    assert agent.returncode == 0, agent.stderr
    samples = [r for r in ingest.stored() if r.get("kind") == "resource"]
    assert len(samples) >= 3, samples
    assert max(s["cpu_cores"] for s in samples) > 0.3  # a burning learner, shared with the rest of the machine
    # The last is taken as the learner ends, when nothing of it holds memory any more.
    assert all(s["memory_bytes"] > 0 and s["memory_limit_bytes"] == 2**30 for s in samples[:-1])


def test_a_batch_change_reaches_the_learner_in_a_pod(outside_tmp, ingest):
    """The agent keeps the learner's control file in its state folder (the config mount is read-only)."""
    ingest.answer_extra = {"batch": {"id": 4, "global_batch": 96, "local_batch": 48, "lr_scale": 1.5}}
    command = ("python3 -c 'import time\n"
               "from learner_agent.batch_changes import BatchChanges\n"
               "changes = BatchChanges()\n"
               "deadline = time.monotonic() + 20\n"
               "while (change := changes.poll()) is None and time.monotonic() < deadline:\n"
               "    print(\"waiting\", flush=True); time.sleep(0.2)\n"
               "changes.applied(change, step=3)\n'")
    config, state_dir, _ = kubernetes_layout(outside_tmp, ingest, command=command)
    try:
        agent = subprocess.run(agent_command(config), env=agent_env(), capture_output=True, timeout=60)
    finally:
        os.chmod(os.path.dirname(config), 0o755)
    assert agent.returncode == 0, agent.stderr
    applied = [(r["name"], r["value"], r.get("step")) for r in ingest.stored() if r["kind"] == "metric"]
    assert applied == [("batch_changes", 1.0, None), ("batch_applied", 4.0, 3)]
    assert json.loads(open(os.path.join(state_dir, "control", "batch.json")).read())["global_batch"] == 96
