"""The learner's control group: limits written where each hierarchy wants them, and real limits biting."""
import os

import pytest

from learner_agent import cgroups
from tests.support.agent_runs import CPU_BURNER, needs_cgroups, read_exit, run_agent, write_agent_config


def fake_v1(tmp_path):
    roots = {c: tmp_path / c for c in ("memory", "cpu", "pids")}
    for root in roots.values():
        root.mkdir()
    mounts = tmp_path / "mounts"
    mounts.write_text(f"cgroup {roots['memory']} cgroup rw,memory 0 0\n"
                      f"cgroup {roots['cpu']} cgroup rw,cpu,cpuacct 0 0\n"
                      f"cgroup {roots['pids']} cgroup rw,pids 0 0\n")
    own = tmp_path / "own"
    own.write_text("4:memory:/agents/a1\n2:cpu,cpuacct:/\n1:pids:/\n0::/\n")
    return roots, mounts, own


def fake_v2(tmp_path, controllers="cpuset cpu io memory pids"):
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    mounts = tmp_path / "mounts"
    mounts.write_text(f"cgroup2 {root} cgroup2 rw 0 0\n")
    return root, mounts


def test_v1_groups_sit_below_the_agents_own_with_every_limit(tmp_path):
    roots, mounts, own = fake_v1(tmp_path)
    (roots["memory"] / "agents" / "a1").mkdir(parents=True)
    group = cgroups.create("training-x/a1 l0", memory_bytes=2**30, cpus=0.5, max_processes=64,
                           mounts=mounts, own=own)
    memory = roots["memory"] / "agents" / "a1" / "trainyard" / "training-x_a1_l0"
    cpu, pids = roots["cpu"] / "trainyard" / "training-x_a1_l0", roots["pids"] / "trainyard" / "training-x_a1_l0"
    assert (memory / "memory.limit_in_bytes").read_text() == str(2**30)
    assert (cpu / "cpu.cfs_quota_us").read_text() == "50000"
    assert (cpu / "cpu.cfs_period_us").read_text() == "100000"
    assert (pids / "pids.max").read_text() == "64"
    assert group.procs_files == sorted(str(d / "cgroup.procs") for d in (memory, cpu, pids))
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    assert group.oom_kills() == 0
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert group.oom_kills() == 2
    for d in (memory, cpu, pids):
        for f in d.iterdir():
            f.unlink()
    assert group.remove() == [] and not memory.exists() and not cpu.exists()


def test_v2_is_used_when_it_has_the_controllers(tmp_path):
    root, mounts = fake_v2(tmp_path)
    group = cgroups.create("j-a1-l0", memory_bytes=300 * 2**20, cpus=2, max_processes=100, mounts=mounts,
                           own=tmp_path / "unused")
    path = root / "trainyard" / "j-a1-l0"
    assert group.version == 2 and group.procs_files == [str(path / "cgroup.procs")]
    assert (root / "cgroup.subtree_control").read_text() == "+memory +cpu +pids"
    assert (root / "trainyard" / "cgroup.subtree_control").read_text() == "+memory +cpu +pids"
    assert (path / "memory.max").read_text() == str(300 * 2**20)
    assert (path / "cpu.max").read_text() == "200000 100000"
    assert (path / "pids.max").read_text() == "100"
    (path / "memory.events").write_text("low 0\nhigh 0\nmax 5\noom 1\noom_kill 1\n")
    assert group.oom_kills() == 1


def test_without_any_hierarchy_it_says_why(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("proc /proc proc rw 0 0\n")
    with pytest.raises(cgroups.CgroupError, match="no cgroup v1 memory, cpu, pids"):
        cgroups.create("j", memory_bytes=None, cpus=1, max_processes=10, mounts=mounts, own=tmp_path / "own")


@needs_cgroups
def test_a_sandboxed_learner_gets_its_share_of_cpu_and_no_more(outside_tmp, ingest):
    config = write_agent_config(outside_tmp, ingest, command=CPU_BURNER, sandbox="bwrap", cpus=0.3)
    assert run_agent(config).returncode == 0
    lines = [r["line"] for r in ingest.stored() if r["kind"] == "log"]
    share = float(next(line for line in lines if line.startswith("cpu share")).split()[-1])
    assert share < 0.45, lines
    assert read_exit(config)["exit_code"] == 0


@needs_cgroups
def test_files_in_tmp_count_against_the_memory_limit(outside_tmp, ingest):
    # The process's RSS stays small: only the cgroup sees the file in the tmpfs.
    command = ("python3 -c \"import time\nwith open('/tmp/fill', 'wb') as f:\n"
               "    for _ in range(300): f.write(b'x' * 2**20); f.flush()\nprint('written', flush=True)\n"
               "time.sleep(30)\"")
    config = write_agent_config(outside_tmp, ingest, command=command, sandbox="bwrap", memory_bytes=150 * 2**20)
    assert run_agent(config, timeout=60).returncode == 0
    assert read_exit(config) == {**read_exit(config), "exit_code": 137,
                                 "reason": "memory limit 150.0MiB exceeded (OOM killed)"}
    assert "written" not in [r.get("line") for r in ingest.stored()]


def test_a_standby_group_is_adopted_as_the_learners_with_its_limits_and_in_every_hierarchy(tmp_path):
    roots, mounts, own = fake_v1(tmp_path)
    group = cgroups.standby("f1", mounts=mounts, own=own)
    memory = roots["memory"] / "agents" / "a1" / "trainyard"
    assert group.standing_by and (memory / "standby-f1").is_dir()
    assert not (memory / "standby-f1" / "memory.limit_in_bytes").exists()  # no limits while it waits
    group.adopt("training-x-a1-l0", memory_bytes=2**30, cpus=0.5, max_processes=64)
    assert not group.standing_by and not (memory / "standby-f1").exists()
    assert (memory / "training-x-a1-l0" / "memory.limit_in_bytes").read_text() == str(2**30)
    assert (roots["cpu"] / "trainyard" / "training-x-a1-l0" / "cpu.cfs_quota_us").read_text() == "50000"
    assert (roots["pids"] / "trainyard" / "training-x-a1-l0" / "pids.max").read_text() == "64"
    assert group.procs_files == sorted(str(root / "training-x-a1-l0" / "cgroup.procs") for root in (
        memory, roots["cpu"] / "trainyard", roots["pids"] / "trainyard"))


def test_a_standby_group_that_cannot_take_the_learners_name_everywhere_keeps_its_own(tmp_path):
    roots, mounts, own = fake_v1(tmp_path)
    group = cgroups.standby("f1", mounts=mounts, own=own)
    taken = roots["pids"] / "trainyard" / "j-a1-l0"
    (taken / "leftover").mkdir(parents=True)  # a group of that name with one inside: no rename onto it
    with pytest.raises(cgroups.CgroupError, match="cannot rename"):
        group.adopt("j-a1-l0", memory_bytes=None, cpus=1, max_processes=10)
    assert group.standing_by  # all or nothing: the hierarchies renamed before are named back
    assert all(os.path.isdir(d) and os.path.basename(d) == "standby-f1" for d in group.dirs.values())
    assert not (roots["cpu"] / "trainyard" / "j-a1-l0").exists()


def test_no_standby_group_where_groups_cannot_be_renamed(tmp_path):
    root, mounts = fake_v2(tmp_path, "cpu memory pids")
    with pytest.raises(cgroups.CgroupError, match="cannot be renamed"):
        cgroups.standby("f1", mounts=mounts, own=tmp_path / "unused")
    assert not (root / "trainyard").exists()


def test_standby_groups_left_empty_for_a_while_are_removed_and_no_other(tmp_path):
    roots, mounts, own = fake_v1(tmp_path)
    old, new = (cgroups.standby(name, mounts=mounts, own=own) for name in ("old", "new"))
    learners = cgroups.create("j-a1-l0", memory_bytes=None, cpus=1, max_processes=10, mounts=mounts, own=own)
    for path in [*old.dirs.values(), *learners.dirs.values()]:
        os.utime(path, (0, 0))
    busy = roots["cpu"] / "trainyard" / "standby-busy"
    (busy / "inside").mkdir(parents=True)  # stands for a group with a process: rmdir fails
    os.utime(busy, (0, 0))
    cgroups.remove_stale_standby(mounts=mounts, own=own)
    assert not any(os.path.exists(d) for d in old.dirs.values())
    assert all(os.path.isdir(d) for d in [*new.dirs.values(), *learners.dirs.values(), busy])


def pod_group(tmp_path, *, files=("memory.current", "cpu.stat")):
    """A Kubernetes container's view: its own group is the root of the cgroup namespace it sees."""
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    for name in files:
        (root / name).write_text({"memory.current": "314572800\n", "memory.peak": "419430400\n",
                                  "cpu.stat": "usage_usec 2500000\nuser_usec 2000000\n"}[name])
    (root / "cgroup.procs").write_text("1\n7\n")
    mounts = tmp_path / "mounts"
    mounts.write_text(f"cgroup2 {root} cgroup2 ro 0 0\n")
    own = tmp_path / "own"
    own.write_text("0::/\n")
    return root, mounts, own


def test_in_a_pod_the_sampler_reads_the_containers_own_group(tmp_path):
    from learner_agent import telemetry
    root, mounts, own = pod_group(tmp_path, files=("memory.current", "memory.peak", "cpu.stat"))
    group = cgroups.own_v2(mounts=mounts, own=own)
    assert (group.version, group.dirs["memory"], group.pids()) == (2, str(root), {1, 7})
    usage = telemetry.read_usage(cgroup=group, pid=None)
    assert (usage.cpu_seconds, usage.memory_bytes, usage.memory_peak_bytes) == (2.5, 300 * 2**20, 400 * 2**20)


def test_a_hierarchys_root_is_the_whole_machine_and_never_read_as_ones_own(tmp_path):
    _, mounts, own = pod_group(tmp_path, files=("cpu.stat",))  # the root has no memory.current
    assert cgroups.own_v2(mounts=mounts, own=own) is None
    mounts.write_text("proc /proc proc rw 0 0\n")  # no cgroup v2 at all
    assert cgroups.own_v2(mounts=mounts, own=own) is None
