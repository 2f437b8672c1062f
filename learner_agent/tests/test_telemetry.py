"""learner_agent.telemetry against real processes (a core burnt, memory held) with and without a control
group, and its NVML path against a stand-in pynvml module."""
import logging
import os
import subprocess
import sys
import time
import types

import pytest

from learner_agent import cgroups, telemetry
from learner_agent.config import ConfigError, parse_config

BURN = "while True: pass"
# Every page written, so all of it is resident (a fresh bytearray is zero pages the kernel maps lazily).
HOLD_300_MIB = ("import sys, time\n"
                "b = bytearray(300 * 2**20)\n"
                "b[::4096] = b'x' * (len(b) // 4096)\n"
                "print('held', flush=True)\n"
                "time.sleep(600)\n")


def _start(code, group=None):
    """The process, inside `group` from before its exec, as the launcher puts a learner in its group
    (memory charged before a move stays where it was charged)."""
    join = (lambda: group.join(os.getpid())) if group is not None else None
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, preexec_fn=join)


def _end(proc):
    proc.kill()
    proc.wait()


def _cgroup_or_skip(name):
    if os.geteuid() != 0:
        pytest.skip("control groups need root")
    try:
        return cgroups.create(f"telemetry-test-{name}-{os.getpid()}", memory_bytes=2**31, cpus=2, max_processes=64)
    except cgroups.CgroupError as e:
        pytest.skip(f"no control group here: {e}")


def _own_cpu_seconds(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _vm_rss(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _sampler(records, *, cgroup, pid, gpus=None):
    return telemetry.Sampler(period_s=3600, emit=records.append, cgroup=cgroup, pid=pid,
                             memory_limit_bytes=2**31, visible_gpus="", gpus=gpus)


def _cpu_over(sampler, pid, seconds):
    """(cores the sampler read, cores the process's own /proc counters say) over the same window."""
    sampler.start()
    own_before, wall_before = _own_cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    record = sampler.record()
    own = (_own_cpu_seconds(pid) - own_before) / (time.monotonic() - wall_before)
    return record["cpu_cores"], own


@pytest.mark.parametrize("with_cgroup", [False, True], ids=["proc", "cgroup"])
def test_it_reads_one_busy_core_as_about_one_core(with_cgroup):
    group = _cgroup_or_skip("cpu") if with_cgroup else None
    burner = _start(BURN, group)
    try:
        cores, own = _cpu_over(_sampler([], cgroup=group, pid=burner.pid), burner.pid, 3.0)
    finally:
        _end(burner)
        if group is not None:
            group.remove()
    # On a machine whose cores other work shares, the burner may get less than a core: the reading
    # must then say what it got. Given a whole core, it reads 90-110%.
    assert abs(cores - own) <= 0.05, f"read {cores:.3f} cores; the burner's own counters say {own:.3f}"
    if own >= 0.97:
        assert 0.9 <= cores <= 1.1


@pytest.mark.parametrize("with_cgroup", [False, True], ids=["proc", "cgroup"])
def test_it_reads_300_mib_held_within_5_percent_of_proc(with_cgroup):
    group = _cgroup_or_skip("memory") if with_cgroup else None
    holder = _start(HOLD_300_MIB, group)
    try:
        assert holder.stdout.readline().strip() == "held"
        sampler = _sampler([], cgroup=group, pid=holder.pid)
        sampler.start()
        record = sampler.record()
        proc_rss = _vm_rss(holder.pid)
    finally:
        _end(holder)
        if group is not None:
            group.remove()
    assert proc_rss > 300 * 2**20
    assert abs(record["memory_bytes"] - proc_rss) <= 0.05 * proc_rss, (record["memory_bytes"], proc_rss)
    assert record["memory_peak_bytes"] >= record["memory_bytes"]
    assert record["memory_limit_bytes"] == 2**31
    assert "gpus" not in record


def test_it_keeps_the_peak_between_samples_without_a_group():
    holder = _start(HOLD_300_MIB)
    try:
        assert holder.stdout.readline().strip() == "held"
        records = []
        sampler = _sampler(records, cgroup=None, pid=holder.pid)
        sampler.start()
        sampler.sample_now()
    finally:
        _end(holder)
    sampler.sample_now()  # the learner is gone: nothing now, the peak it reached stays
    assert records[1]["memory_bytes"] == 0
    assert records[1]["memory_peak_bytes"] == records[0]["memory_peak_bytes"] > 300 * 2**20


def test_stop_takes_a_last_sample_and_ends_the_thread():
    records = []
    sampler = telemetry.Sampler(period_s=0.05, emit=records.append, cgroup=None, pid=os.getpid(),
                                memory_limit_bytes=None, visible_gpus="")
    sampler.start()
    time.sleep(0.3)
    sampler.stop()
    count = len(records)
    time.sleep(0.2)
    assert count >= 3 and len(records) == count
    assert all(r["kind"] == "resource" and r["memory_bytes"] > 0 for r in records)


# --- NVML, through a stand-in for pynvml ---

class NVMLError(Exception):
    pass


def fake_pynvml(*, devices, processes=None, init_error=None, no_power=()):
    """A module with pynvml's names: `devices` {index: (uuid, util %, used, total, milliwatts)}."""
    module = types.ModuleType("pynvml")
    module.NVMLError = NVMLError
    module.calls = []
    processes = processes or {}

    def init():
        module.calls.append("init")
        if init_error:
            raise NVMLError(init_error)

    def handle_by_uuid(uuid):
        return next(i for i, d in devices.items() if d[0] == uuid)

    def power(handle):
        if handle in no_power:
            raise NVMLError("Not Supported")
        return devices[handle][4]

    module.nvmlInit = init
    module.nvmlShutdown = lambda: module.calls.append("shutdown")
    module.nvmlDeviceGetCount = lambda: len(devices)
    module.nvmlDeviceGetHandleByIndex = lambda i: i if i in devices else (_ for _ in ()).throw(NVMLError("Invalid Argument"))
    module.nvmlDeviceGetHandleByUUID = handle_by_uuid
    module.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=devices[h][1], memory=0)
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=devices[h][2], total=devices[h][3], free=0)
    module.nvmlDeviceGetPowerUsage = power
    module.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in processes.get(h, [])]
    return module


DEVICES = {0: ("GPU-aaaa", 3, 1 * 2**30, 80 * 2**30, 70_000), 1: ("GPU-bbbb", 97, 40 * 2**30, 80 * 2**30, 650_500)}


def test_it_samples_the_learners_own_gpus_as_it_numbers_them():
    # The learner was given physical GPU 1, which it sees as its GPU 0; another job's process shares it.
    nvml = fake_pynvml(devices=DEVICES, processes={1: [(4242, 30 * 2**30), (999, 10 * 2**30)]})
    gpus = telemetry.Gpus("1", nvml=nvml)
    assert gpus.available
    assert gpus.sample({4242, 4243}) == [{
        "index": 0, "utilization": 97.0, "memory_used_bytes": 40 * 2**30, "memory_total_bytes": 80 * 2**30,
        "power_watts": 650.5, "learner_memory_bytes": 30 * 2**30}]
    gpus.close()
    assert nvml.calls == ["init", "shutdown"]


def test_it_finds_gpus_by_uuid_and_all_of_them_when_none_are_named():
    nvml = fake_pynvml(devices=DEVICES)
    assert [g["utilization"] for g in telemetry.Gpus("GPU-bbbb,GPU-aaaa", nvml=nvml).sample(set())] == [97.0, 3.0]
    assert [g["index"] for g in telemetry.Gpus(None, nvml=nvml).sample(set())] == [0, 1]


def test_a_reading_the_device_does_not_give_is_none_not_a_lost_sample():
    gpus = telemetry.Gpus("0,1", nvml=fake_pynvml(devices=DEVICES, no_power={1}))
    assert [g["power_watts"] for g in gpus.sample(set())] == [70.0, None]


def test_a_learner_without_gpus_never_asks_nvml(caplog):
    nvml = fake_pynvml(devices=DEVICES)
    with caplog.at_level(logging.WARNING, logger="learner_agent.telemetry"):
        gpus = telemetry.Gpus("", nvml=nvml)
    assert not gpus.available and nvml.calls == [] and caplog.records == []


def test_nvml_without_a_driver_is_said_once_and_cpu_and_memory_are_still_sampled(caplog):
    nvml = fake_pynvml(devices=DEVICES, init_error="Driver Not Loaded")
    records = []
    with caplog.at_level(logging.WARNING, logger="learner_agent.telemetry"):
        sampler = telemetry.Sampler(period_s=3600, emit=records.append, cgroup=None, pid=os.getpid(),
                                    memory_limit_bytes=None, visible_gpus="0", gpus=telemetry.Gpus("0", nvml=nvml))
        sampler.start()
        sampler.sample_now()
        sampler.sample_now()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "Driver Not Loaded" in said[0] and "CPU and memory only" in said[0]
    assert len(records) == 2 and all("gpus" not in r and r["memory_bytes"] > 0 for r in records)


def test_without_pynvml_it_says_so_once(caplog, monkeypatch):
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    with caplog.at_level(logging.WARNING, logger="learner_agent.telemetry"):
        gpus = telemetry.Gpus("0", search_path=[])
    assert not gpus.available
    assert [r.getMessage() for r in caplog.records] == [
        "no GPU telemetry: the pynvml module (nvidia-ml-py) is not installed (looked in no folder); sampling CPU and "
        "memory only"]


def test_pynvml_is_found_as_a_file_in_a_site_folder(tmp_path, monkeypatch):
    # The agent runs with -S: site-packages are not on its path, yet an installed pynvml is used.
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    (tmp_path / "pynvml.py").write_text("MARK = 'the installed one'\n")
    module, why = telemetry.load_nvml([str(tmp_path / "missing"), str(tmp_path)])
    assert why == "" and module.MARK == "the installed one"
    assert str(tmp_path) not in sys.path


def test_a_pynvml_that_looks_itself_up_while_it_loads_is_loaded(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    (tmp_path / "pynvml.py").write_text("import sys\nSELF = sys.modules[__name__]\n")
    module, why = telemetry.load_nvml([str(tmp_path)])
    assert why == "" and module.SELF is module


def test_the_site_folders_include_the_virtual_environment_of_the_interpreter(tmp_path, monkeypatch):
    # Under -S, sys.prefix is the base interpreter's: the environment's own folder must be added.
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python3"))
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert str(tmp_path / "venv" / "lib" / version / "site-packages") in telemetry._site_folders()


def test_the_agent_finds_an_installed_pynvml_though_it_runs_with_dash_s(tmp_path):
    # The agent's own interpreter, started as the local backend starts it: site-packages are off its path.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (venv / "lib" / version / "site-packages" / "pynvml.py").write_text("MARK = 'found'\n")
    code = ("import sys; from learner_agent import telemetry; m, why = telemetry.load_nvml(); "
            "print(m.MARK if m else why, 'site-packages' in ' '.join(sys.path))")
    out = subprocess.run([str(venv / "bin" / "python3"), "-S", "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": os.path.dirname(os.path.dirname(telemetry.__file__))})
    assert out.stdout.split() == ["found", "False"], out.stderr


def test_a_broken_pynvml_is_no_gpus_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    (tmp_path / "pynvml.py").write_text("raise OSError('libnvidia-ml.so.1: cannot open shared object file')\n")
    module, why = telemetry.load_nvml([str(tmp_path)])
    assert module is None and "libnvidia-ml.so.1" in why and "pynvml" not in sys.modules


# --- the setting ---

def _config(**overrides):
    data = {"job_id": "training-x", "attempt": 1, "learner": 0, "command": "true", "code_archive": "c.zip",
            "work_dir": "work", "ingest_url": "http://127.0.0.1:1/", "ingest_token": "t", **overrides}
    return parse_config(data, path="/tmp/agent.json")


def test_the_sampling_period_is_a_setting_and_off_unless_given():
    assert _config().resource_sample_s == 0.0
    assert _config(resource_sample_s=5).resource_sample_s == 5.0
    with pytest.raises(ConfigError, match="resource_sample_s"):
        _config(resource_sample_s=-1)


def test_the_nvml_module_is_an_absolute_path_and_none_unless_given():
    assert _config().nvml_module == ""
    assert _config(nvml_module="/opt/virtual_nvml.py").nvml_module == "/opt/virtual_nvml.py"
    with pytest.raises(ConfigError, match="nvml_module"):
        _config(nvml_module="virtual_nvml.py")


# --- a module named in place of pynvml: the virtual GPUs' stand-in ---
VIRTUAL_NVML = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "support", "virtual_nvml.py")


def test_a_module_the_platform_names_is_loaded_in_place_of_pynvml(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    (tmp_path / "pynvml.py").write_text("MARK = 'installed'\n")
    (tmp_path / "stand_in.py").write_text("MARK = 'named'\n")
    module, why = telemetry.load_nvml([str(tmp_path)], module_path=str(tmp_path / "stand_in.py"))
    assert why == "" and module.MARK == "named"
    monkeypatch.delitem(sys.modules, "pynvml")
    module, why = telemetry.load_nvml([str(tmp_path)], module_path=str(tmp_path / "gone.py"))
    assert module is None and "gone.py" in why


# Bounds wide enough for a shared machine: the burning child gets a core only part of the time there.
@pytest.mark.parametrize("code, low, high", [("print('go', flush=True)\nwhile True: pass", 25, 100),
                                             ("import time; print('go', flush=True); time.sleep(30)", 0, 5)])
def test_a_virtual_gpu_reads_its_learners_cpu_as_its_utilisation(monkeypatch, code, low, high):
    # The stand-in runs inside the agent, whose descendants are its learner: here, this test's child.
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    learner = _start(code)
    # This test's process has other children (platforms of module fixtures): only the learner counts.
    monkeypatch.setenv("VIRTUAL_NVML_LEARNER_PID", str(learner.pid))
    try:
        assert learner.stdout.readline() == "go\n"  # started: what its start-up cost is not counted
        gpus = telemetry.Gpus("0", module_path=os.path.abspath(VIRTUAL_NVML))
        assert gpus.available
        time.sleep(1.5)
        (reading,) = gpus.sample({learner.pid})
        assert low <= reading["utilization"] <= high, reading
        gpus.close()
    finally:
        learner.kill()
        learner.wait()


# --- in the agent: resource records through the spool, beside the learner's output ---

def test_the_agent_ships_resource_records_while_the_learner_runs_and_one_as_it_ends(ingest, outside_tmp):
    from tests.support.agent_runs import read_exit, run_agent, write_agent_config

    burn_then_exit = ("import os, time\nend = time.time() + 2.5\nwhile time.time() < end: pass\n"
                      "t = os.times()\nprint(t.user + t.system)\n")
    config = write_agent_config(outside_tmp, ingest, command="python3 burn.py", files={"burn.py": burn_then_exit},
                                resource_sample_s=0.5, memory_bytes=2**30)
    result = run_agent(config)
    assert result.returncode == 0, result.stderr
    assert read_exit(config)["exit_code"] == 0
    stored = ingest.stored()
    kinds = [r["kind"] for r in stored]
    samples = [r for r in stored if r["kind"] == "resource"]
    assert len(samples) >= 4
    # The last sample was taken as the learner ended, before the agent said it had.
    assert kinds.index("resource") > kinds.index("status") and max(
        i for i, k in enumerate(kinds) if k == "resource") < len(kinds) - 1 and stored[-1]["state"] == "exited"
    assert all(s["memory_limit_bytes"] == 2**30 and s["memory_bytes"] >= 0 for s in samples)
    # What the samples add up to is what the learner says it burnt (a shared machine may give it less
    # than a core, so its own count is the measure).
    burnt = float(next(r["line"] for r in stored if r["kind"] == "log"))
    intervals = [b["time"] - a["time"] for a, b in zip(samples, samples[1:])]
    read = sum(s["cpu_cores"] * dt for s, dt in zip(samples[1:], intervals))
    assert burnt > 0.1 and 0.6 * burnt <= read <= 1.2 * burnt, (read, burnt)
    with open(os.path.join(os.path.dirname(config), "agent.log")) as f:
        said = [line for line in f if "no GPU telemetry" in line]
    assert said == [] or len(said) == 1


def test_the_agent_samples_nothing_when_sampling_is_off(ingest, outside_tmp):
    from tests.support.agent_runs import run_agent, write_agent_config

    config = write_agent_config(outside_tmp, ingest, command="sleep 1", resource_sample_s=0)
    assert run_agent(config).returncode == 0
    assert [r for r in ingest.stored() if r["kind"] == "resource"] == []
