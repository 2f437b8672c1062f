"""What the learner really uses: CPU, memory against its limit, and its GPUs, sampled every few seconds.

Each sample is one `resource` record, spooled and shipped like the learner's metrics (so none is lost
when the agent restarts, and the platform stores each once). The sources, best first:

- CPU: the learner's control group (cgroup v2 `cpu.stat`, v1 `cpuacct.usage` where cpuacct shares the
  cpu hierarchy), else the CPU times in /proc/<pid>/stat of the group's processes or of the learner's
  process tree. A group counts processes that already ended; /proc sums lose what a process that was
  never waited for used, which is why it is the fallback.
- Memory: the group's `memory.current`/`memory.peak` (v1 `memory.usage_in_bytes`/
  `memory.max_usage_in_bytes`), else the processes' RSS with the peak kept here between samples.
- GPUs: NVML through `pynvml` (nvidia-ml-py), loaded lazily and only for a learner that has GPUs. The
  agent runs on the standard library alone, with `python -S` (no site-packages on its path): the
  module is looked up in the interpreter's site folders by file, so nothing else from there is
  imported. No NVML (no module, no driver) is said once in agent.log, and CPU and memory are
  sampled all the same.
"""
import collections
import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import threading
import time

from learner_agent import cgroups, procfs

log = logging.getLogger(__name__)

_TICKS = os.sysconf("SC_CLK_TCK")


# One reading of the learner's CPU and memory counters: cumulative CPU seconds, bytes now, peak.
Usage = collections.namedtuple("Usage", ("cpu_seconds", "memory_bytes", "memory_peak_bytes"))


def read_usage(*, cgroup, pid):
    """The learner's CPU seconds so far and its memory, from its group when it has one, else /proc."""
    if cgroup is not None:
        cpu = _cgroup_cpu_seconds(cgroup)
        memory, peak = _cgroup_memory(cgroup)
        if cpu is None or memory is None:
            pids = cgroup.pids()
            if cpu is None:
                cpu = _proc_cpu_seconds(pids)
            if memory is None:
                memory = _proc_rss(pids)
        return Usage(cpu, memory, peak)
    table_pids = [pid, *procfs.descendants(pid)] if pid is not None else []
    return Usage(_proc_cpu_seconds(table_pids), _proc_rss(table_pids), None)


def _cgroup_cpu_seconds(cgroup):
    directory = cgroup.dirs["cpu"]
    if cgroup.version == 2:
        usec = cgroups.read_key(os.path.join(directory, "cpu.stat"), "usage_usec")
        return None if usec is None else usec / 1e6
    nsec = cgroups.read_int(os.path.join(directory, "cpuacct.usage"))  # only where cpuacct is mounted with cpu
    return None if nsec is None else nsec / 1e9


def _cgroup_memory(cgroup):
    """(bytes now, peak bytes or None) of the group."""
    directory = cgroup.dirs["memory"]
    if cgroup.version == 2:
        now, peak = "memory.current", "memory.peak"
    else:
        now, peak = "memory.usage_in_bytes", "memory.max_usage_in_bytes"
    return cgroups.read_int(os.path.join(directory, now)), cgroups.read_int(os.path.join(directory, peak))


def _proc_cpu_seconds(pids):
    """User and system time of the processes, with what they collected from children they waited for."""
    ticks = 0
    for pid in pids:
        fields = procfs.stat_fields(pid)
        if fields is not None:
            try:  # stat fields 14-17 (utime, stime, cutime, cstime); fields[0] is field 3
                ticks += sum(int(x) for x in fields[11:15])
            except ValueError:
                continue
    return ticks / _TICKS


def _proc_rss(pids):
    total = 0
    for pid in pids:
        fields = procfs.stat_fields(pid)
        if fields is not None:
            try:
                total += int(fields[21]) * procfs.PAGE_BYTES  # stat field 24
            except (IndexError, ValueError):
                continue
    return total


class Gpus:
    """The learner's GPUs through NVML; `available` is False (and why said once) when it can't be had.

    `visible`: the learner's CUDA_VISIBLE_DEVICES (indices or UUIDs); None when unset, which on
    Kubernetes means every GPU the container sees is the learner's. `module_path`: a pynvml-compatible
    file to load instead of pynvml (agent.json's `nvml_module`: virtual GPUs, see load_nvml)."""

    def __init__(self, visible, *, nvml=None, search_path=None, module_path=""):
        self.available = False
        self._nvml = nvml
        self._handles = []  # [(index as the learner sees it, handle)]
        wanted = _visible_devices(visible)
        if wanted == []:
            return  # no GPUs: nothing to ask NVML about, and nothing to say
        if self._nvml is None:
            self._nvml, why = load_nvml(search_path, module_path=module_path)
            if self._nvml is None:
                log.warning("no GPU telemetry: %s; sampling CPU and memory only", why)
                return
        try:
            self._nvml.nvmlInit()
            if wanted is None:
                wanted = [str(i) for i in range(self._nvml.nvmlDeviceGetCount())]
            for index, device in enumerate(wanted):
                self._handles.append((index, self._handle(device)))
        except Exception as e:  # NVMLError (no driver, no such device) or a broken module
            log.warning("no GPU telemetry: NVML did not answer (%s); sampling CPU and memory only", _describe(e))
            self._handles = []
            return
        self.available = bool(self._handles)

    def _handle(self, device):
        if device.isdigit():
            return self._nvml.nvmlDeviceGetHandleByIndex(int(device))
        return self._nvml.nvmlDeviceGetHandleByUUID(device)

    def sample(self, pids):
        """[{index, utilization, memory_used_bytes, memory_total_bytes, power_watts, learner_memory_bytes}]:
        one entry per GPU; a reading the device does not give is None. `learner_memory_bytes`: what
        the learner's own processes (`pids`) hold on it, which is what counts where a GPU is shared."""
        gpus = []
        for index, handle in self._handles:
            entry = {"index": index}
            entry["utilization"] = self._ask(lambda: float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
            memory = self._ask(lambda: self._nvml.nvmlDeviceGetMemoryInfo(handle))
            entry["memory_used_bytes"] = int(memory.used) if memory is not None else None
            entry["memory_total_bytes"] = int(memory.total) if memory is not None else None
            milliwatts = self._ask(lambda: self._nvml.nvmlDeviceGetPowerUsage(handle))
            entry["power_watts"] = round(milliwatts / 1000.0, 3) if milliwatts is not None else None
            entry["learner_memory_bytes"] = self._learner_memory(handle, pids)
            gpus.append(entry)
        return gpus

    def _learner_memory(self, handle, pids):
        processes = self._ask(lambda: self._nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        if processes is None:
            return None
        held = [p.usedGpuMemory for p in processes if p.pid in pids and isinstance(p.usedGpuMemory, int)]
        return sum(held)

    @staticmethod
    def _ask(call):
        try:
            return call()
        except Exception:  # NVMLError_NotSupported and kin: this reading is missing, not the sample
            return None

    def close(self):
        if self.available:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self.available = False


def _visible_devices(visible):
    """The learner's GPUs as CUDA names them: None (unset: all), or a list, empty for none."""
    if visible is None:
        return None
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if devices and devices[0] in ("-1", "none", "NoDevFiles"):
        return []
    return devices


def load_nvml(search_path=None, *, module_path=""):
    """(the pynvml module, "") or (None, why not). Imported where sys.path finds it, else loaded from
    its file in the interpreter's site folders (the agent runs with -S), never by adding those
    folders to sys.path. `search_path`: the folders to look in instead (tests).

    `module_path`: a file with pynvml's names to load in its place. The local backend names one
    where its GPUs are virtual (TRAINYARD_LOCAL_NVML_MODULE): a virtual GPU has no counters, and a
    stand-in says what it did (tests/support/virtual_nvml.py reads its learner's CPU use as its
    utilisation), so that what the platform does with utilisation can be run without a GPU."""
    if "pynvml" in sys.modules:
        return sys.modules["pynvml"], ""
    try:
        spec = None
        if module_path:
            if not os.path.isfile(module_path):
                return None, f"the NVML module {module_path} named by the platform is not there"
            spec = importlib.util.spec_from_file_location("pynvml", module_path)
        elif search_path is None and importlib.util.find_spec("pynvml") is not None:
            return importlib.import_module("pynvml"), ""
        folders = _site_folders() if search_path is None else search_path
        for folder in folders if spec is None else ():
            candidate = os.path.join(folder, "pynvml.py")
            if os.path.isfile(candidate):
                spec = importlib.util.spec_from_file_location("pynvml", candidate)
                break
        if spec is None:
            return None, f"the pynvml module (nvidia-ml-py) is not installed (looked in {', '.join(folders) or 'no folder'})"
        module = importlib.util.module_from_spec(spec)
        sys.modules["pynvml"] = module  # as an import would: the module looks itself up there
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop("pynvml", None)
        return None, f"pynvml could not be loaded ({_describe(e)})"
    return module, ""


def _site_folders():
    """Where site-packages would be. Under -S, sys.prefix is the base interpreter's even in a virtual
    environment (site.py is what moves it), so the environment of sys.executable is added by hand;
    and a distribution's patched site.py may name only its own dist-packages for a prefix."""
    import site  # not run at start-up under -S, but its functions still say where the folders are
    prefixes = [sys.prefix, sys.exec_prefix]
    venv = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
    if os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
        prefixes.insert(0, venv)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    folders = [os.path.join(prefix, libdir, version, name) for prefix in prefixes
               for libdir in dict.fromkeys((sys.platlibdir, "lib")) for name in ("site-packages", "dist-packages")]
    folders += site.getsitepackages(prefixes)
    with contextlib.suppress(Exception):
        folders.append(site.getusersitepackages())
    return list(dict.fromkeys(folders))


class Sampler:
    """Samples the learner every `period_s` on a thread of its own and hands each sample to `emit`
    (a `resource` record); `stop` takes one last sample, so the peak that ended a learner killed for
    memory is shown even when it came between two samples."""

    def __init__(self, *, period_s, emit, cgroup, pid, memory_limit_bytes, visible_gpus, gpus=None, nvml_module=""):
        self.period_s = period_s
        self._emit = emit
        self._cgroup = cgroup
        self._pid = pid
        self._limit = memory_limit_bytes
        self._gpus = gpus if gpus is not None else Gpus(visible_gpus, module_path=nvml_module)
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._last = None  # (monotonic time, cumulative CPU seconds)
        self._peak = 0  # the highest memory seen, where the source keeps no peak of its own
        self._thread = None

    def start(self):
        self._last = (time.monotonic(), read_usage(cgroup=self._cgroup, pid=self._pid).cpu_seconds)
        self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stopped.wait(self.period_s):
            self.sample_now()

    def stop(self):
        """One last sample (the learner's counters as it ended), then no more."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(self.period_s + 1.0)
        self.sample_now()
        self._gpus.close()

    def sample_now(self):
        try:
            record = self.record()
        except Exception:  # a sampling bug must never cost the learner its run
            log.exception("resource sampling failed")
            return
        if record is not None:
            self._emit(record)

    def record(self):
        """The next `resource` record, or None before start()."""
        with self._lock:
            if self._last is None:
                return None
            usage = read_usage(cgroup=self._cgroup, pid=self._pid)
            now = time.monotonic()
            then, cpu_then = self._last
            self._last = (now, usage.cpu_seconds)
            # A process that ended unwaited takes its time out of a /proc sum: never a negative rate.
            cores = max(0.0, usage.cpu_seconds - cpu_then) / (now - then) if now > then else 0.0
            self._peak = max(self._peak, usage.memory_bytes, usage.memory_peak_bytes or 0)
            record = {"kind": "resource", "time": time.time(), "cpu_cores": round(cores, 4),
                      "memory_bytes": usage.memory_bytes, "memory_peak_bytes": self._peak,
                      "memory_limit_bytes": self._limit}
            if self._gpus.available:
                record["gpus"] = self._gpus.sample(self._pids())
            return record

    def _pids(self):
        if self._cgroup is not None:
            return self._cgroup.pids()
        return set([self._pid, *procfs.descendants(self._pid)]) if self._pid is not None else set()


def _describe(error):
    return f"{type(error).__name__}: {error}"
