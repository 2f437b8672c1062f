"""What resource sampling costs and how well it reads (learner_agent.telemetry).

`python -m bench telemetry`: real agents run a sleeping learner, side by side, with sampling off, every
5 s and every 0.5 s; the cost is the agent's own CPU seconds (utime + stime in its /proc/<pid>/stat, not
its children's) over one window while the learners run, on minus off, per learner-hour. The readings: a real process
burning one core and one holding 300 MiB, read by the sampler against their own /proc counters, in a
control group where the machine gives one and from /proc without.

`python -m bench.telemetry gpu`: the NVML path on a machine with a GPU: a CUDA matrix-product loop
(PyTorch) read through the agent's sampler beside nvidia-smi's own readings; prints its figures as
JSON (and writes them to $OUT/gpu_telemetry.json when OUT is set).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from learner_agent import cgroups, sandbox, telemetry

WINDOW_S = float(os.environ.get("TRAINYARD_BENCH_TELEMETRY_WINDOW_S", "180"))
REPLICAS = int(os.environ.get("TRAINYARD_BENCH_TELEMETRY_REPLICAS", "3"))
PERIOD_S = 5.0  # the default period (TRAINYARD_RESOURCE_SAMPLE_S)
FAST_PERIOD_S = 0.5  # many samples in a window: the cost of one sample, well above the counters' resolution
TICKS = os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class AgentRun:
    """A real agent (its own ingest endpoint, its own job id, so its own control group) whose learner sleeps."""

    def __init__(self, index, period_s, *, sandbox_mode, seconds):
        from tests.support.agent_runs import IngestServer, agent_command, agent_env, write_agent_config

        self.period_s = period_s
        self.base = tempfile.mkdtemp(prefix="bench-telemetry-", dir="/var/tmp" if os.access("/var/tmp", os.W_OK) else None)
        self.ingest = IngestServer()
        config = write_agent_config(self.base, self.ingest, command=f"sleep {seconds:.0f}", resource_sample_s=period_s,
                                    sandbox=sandbox_mode, flush_timeout_s=5, job_id=f"training-bench{index:04d}")
        self.agent = subprocess.Popen(agent_command(config), env=agent_env(), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)

    def samples(self):
        return sum(1 for r in self.ingest.stored() if r["kind"] == "resource")

    def stop(self):
        self.agent.terminate()  # the agent ends its learner and removes its group
        try:
            self.agent.wait(30)
        except subprocess.TimeoutExpired:
            self.agent.kill()
            self.agent.wait()
        self.ingest.close()
        shutil.rmtree(self.base, ignore_errors=True)


def sampling_cost():
    """The agents' own CPU seconds over one window, all at once: REPLICAS each with sampling off, every
    PERIOD_S and every FAST_PERIOD_S."""
    from tests.support.agent_runs import has_status, wait_for

    sandbox_mode = "auto" if sandbox.bwrap_problem() is None else "none"
    periods = [0.0] * REPLICAS + [PERIOD_S] * REPLICAS + [FAST_PERIOD_S] * REPLICAS
    runs = [AgentRun(i, period, sandbox_mode=sandbox_mode, seconds=WINDOW_S + 60) for i, period in enumerate(periods)]
    try:
        for run in runs:
            wait_for(lambda: has_status(run.ingest, "running"), timeout=120)
        time.sleep(1.0)  # past the start's own work
        before = [(_own_cpu_seconds(run.agent.pid), run.samples()) for run in runs]
        time.sleep(WINDOW_S)
        spent = {}
        for run, (cpu, samples) in zip(runs, before):
            spent.setdefault(run.period_s, []).append((_own_cpu_seconds(run.agent.pid) - cpu, run.samples() - samples))
    finally:
        for run in runs:
            run.stop()
    per_hour = 3600.0 / WINDOW_S
    mean_cpu = {period: sum(cpu for cpu, _ in got) / len(got) for period, got in spent.items()}
    fast_samples = sum(n for _, n in spent[FAST_PERIOD_S]) / REPLICAS
    return {
        "sandbox": sandbox_mode,
        "window_s": WINDOW_S,
        "replicas": REPLICAS,
        "agent_cpu_s_per_learner_hour_off": round(mean_cpu[0.0] * per_hour, 2),
        "agent_cpu_s_per_learner_hour_on": round(mean_cpu[PERIOD_S] * per_hour, 2),
        "sampling_cpu_s_per_learner_hour": round((mean_cpu[PERIOD_S] - mean_cpu[0.0]) * per_hour, 2),
        "sampling_cpu_s_per_learner_hour_every_0_5_s": round((mean_cpu[FAST_PERIOD_S] - mean_cpu[0.0]) * per_hour, 2),
        "sampling_cpu_ms_per_sample": round((mean_cpu[FAST_PERIOD_S] - mean_cpu[0.0]) / fast_samples * 1000, 3),
        "samples_per_window": {str(period): [n for _, n in got] for period, got in spent.items()},
    }


def _start(code, group):
    join = (lambda: group.join(os.getpid())) if group is not None else None
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, preexec_fn=join)


def _group(name):
    try:
        return cgroups.create(f"bench-telemetry-{name}-{os.getpid()}", memory_bytes=2**31, cpus=2, max_processes=64)
    except (cgroups.CgroupError, OSError):
        return None


def readings():
    """The sampler's reading of a core burnt and of 300 MiB held, beside the processes' own counters."""
    figures = {}
    for source in ("cgroup", "proc"):
        group = _group("cpu") if source == "cgroup" else None
        if source == "cgroup" and group is None:
            continue
        burner = _start("while True: pass", group)
        try:
            sampler = telemetry.Sampler(period_s=3600, emit=lambda r: None, cgroup=group, pid=burner.pid,
                                        memory_limit_bytes=None, visible_gpus="")
            time.sleep(0.5)
            sampler.start()
            own_before, wall_before = _own_cpu_seconds(burner.pid), time.monotonic()
            time.sleep(5.0)
            record = sampler.record()
            own = (_own_cpu_seconds(burner.pid) - own_before) / (time.monotonic() - wall_before)
        finally:
            burner.kill()
            burner.wait()
            if group is not None:
                group.remove()
        figures[f"one_core_read_pct_{source}"] = round(record["cpu_cores"] * 100, 1)
        figures[f"one_core_own_counters_pct_{source}"] = round(own * 100, 1)
        # Where other work shares the cores the burner gets less than one: what counts is reading what it got.
        figures[f"one_core_error_pp_{source}"] = round(abs(record["cpu_cores"] - own) * 100, 2)

        group = _group("memory") if source == "cgroup" else None
        holder = _start("import time\nb = bytearray(300 * 2**20)\nb[::4096] = b'x' * (len(b) // 4096)\n"
                        "print('held', flush=True)\ntime.sleep(600)\n", group)
        try:
            holder.stdout.readline()
            sampler = telemetry.Sampler(period_s=3600, emit=lambda r: None, cgroup=group, pid=holder.pid,
                                        memory_limit_bytes=None, visible_gpus="")
            sampler.start()
            record = sampler.record()
            with open(f"/proc/{holder.pid}/status") as f:
                rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        finally:
            holder.kill()
            holder.wait()
            if group is not None:
                group.remove()
        figures[f"memory_300mib_read_mib_{source}"] = round(record["memory_bytes"] / 2**20, 1)
        figures[f"memory_300mib_proc_rss_mib_{source}"] = round(rss / 2**20, 1)
        figures[f"memory_300mib_error_pct_{source}"] = round(abs(record["memory_bytes"] - rss) / rss * 100, 2)
    return figures


def main():
    if os.environ.get("TRAINYARD_BENCH_TELEMETRY_READINGS_ONLY"):
        print(json.dumps(readings()))
        return
    from bench.report import publish
    from bench.targets import bench, shown

    figures = {**readings(), **sampling_cost()}
    headline = {f.key for f in bench("telemetry").figures}
    rows = [(key, value, shown("telemetry", key) if key in headline else "") for key, value in figures.items()
            if isinstance(value, (int, float))]
    publish("telemetry", rows, figures)


# --- on a GPU machine ---

GPU_LOAD = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
hold = torch.empty(6 * 2**30, dtype=torch.uint8, device="cuda")
(a @ b).sum().item()
print("ready", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for _ in range(50):
        c = a @ b
    torch.cuda.synchronize()
"""


def _nvidia_smi():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used,power.draw",
                              "--format=csv,noheader,nounits", "-i", "0"], capture_output=True, text=True, timeout=10)
        util, used_mib, watts = (x.strip() for x in out.stdout.strip().splitlines()[0].split(","))
        return {"utilization": float(util), "memory_used_bytes": int(float(used_mib) * 2**20), "power_watts": float(watts)}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def gpu_main(load_s=20.0, period_s=2.0):
    module, why = telemetry.load_nvml()
    result = {"pynvml": getattr(module, "__file__", None), "pynvml_problem": why, "samples": []}
    gpus = telemetry.Gpus("0")
    result["nvml_available"] = gpus.available
    idle = gpus.sample(set()) if gpus.available else None
    result["idle"] = {"agent": idle, "nvidia_smi": _nvidia_smi()}
    load = subprocess.Popen(["python3", "-c", GPU_LOAD, str(load_s)], stdout=subprocess.PIPE, text=True)
    try:
        result["load_started"] = load.stdout.readline().strip() == "ready"
        if not result["load_started"]:
            raise SystemExit(json.dumps(result, indent=1))
        sampler = telemetry.Sampler(period_s=3600, emit=result["samples"].append, cgroup=None, pid=load.pid,
                                    memory_limit_bytes=None, visible_gpus="0", gpus=gpus)
        sampler.start()
        deadline = time.monotonic() + load_s - period_s
        while time.monotonic() < deadline:
            time.sleep(period_s)
            sampler.sample_now()
            result["samples"][-1]["nvidia_smi"] = _nvidia_smi()
    finally:
        load.kill()
        load.wait()
        gpus.close()
    result["agent_run"] = _agent_on_gpu(load_s=12.0, period_s=period_s)
    text = json.dumps(result, indent=1)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_telemetry.json"), "w") as f:
            f.write(text + "\n")
    return result


def _agent_on_gpu(*, load_s, period_s):
    """A real agent (started as the local backend starts it, `python -S`) running the load as its
    learner on GPU 0: the `resource` records it shipped, and what its log said about NVML."""
    from learner_agent.agent import agent_argv
    from tests.support.agent_runs import IngestServer, agent_env, write_agent_config

    base = tempfile.mkdtemp(prefix="bench-telemetry-gpu-")
    ingest = IngestServer()
    try:
        env = {"CUDA_VISIBLE_DEVICES": "0"}
        if os.environ.get("LD_LIBRARY_PATH"):
            env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
        config = write_agent_config(base, ingest, command=f"{sys.executable} load.py {load_s}",
                                    files={"load.py": GPU_LOAD}, resource_sample_s=period_s, env=env,
                                    memory_bytes=16 * 2**30, flush_timeout_s=10)
        run = subprocess.run(agent_argv(config), env=agent_env(), capture_output=True, text=True, timeout=load_s + 120)
        with open(os.path.join(os.path.dirname(config), "agent.log")) as f:
            said = [line.strip() for line in f if "GPU" in line or "NVML" in line or "nvml" in line]
        samples = [r for r in ingest.stored() if r["kind"] == "resource"]
        logs = [r["line"] for r in ingest.stored() if r["kind"] == "log"][-5:]
        return {"returncode": run.returncode, "agent_log_gpu_lines": said, "learner_log_tail": logs,
                "samples": [{k: r.get(k) for k in ("cpu_cores", "memory_bytes", "gpus")} for r in samples]}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        ingest.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["gpu"]:
        gpu_main()
    else:
        main()
