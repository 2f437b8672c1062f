"""A stand-in for pynvml for virtual GPUs (TRAINYARD_LOCAL_GPUS without a real GPU): the local backend's
agents load it in place of NVML when TRAINYARD_LOCAL_NVML_MODULE names this file
(learner_agent.telemetry.load_nvml).

A virtual GPU has no counters, so this decides what its utilisation is: the CPU its learner used since
the last reading, in percent of one core (at most 100). The learner is every process below the agent
that loaded this module (it is loaded inside the agent), so a learner that computes keeps its virtual
GPUs busy and one that sleeps leaves them idle; every GPU of a learner reads the same. Memory and power
are fixed, plausible figures. Standard library only, and nothing of NVML's that the agent does not call.
"""
import os
import threading
import time
from types import SimpleNamespace

from learner_agent import procfs

_TICKS = os.sysconf("SC_CLK_TCK")
_TOTAL_BYTES = 16 * 2**30
DEVICES = 8  # what nvmlDeviceGetCount says (a learner without CUDA_VISIBLE_DEVICES sees them all)
_lock = threading.Lock()
_last = {}  # {handle: (monotonic time, CPU seconds of the learner then)}


class NVMLError(Exception):
    pass


def nvmlInit():
    now, cpu = time.monotonic(), _learner_cpu_seconds()
    with _lock:
        for handle in range(DEVICES):
            _last[handle] = (now, cpu)


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    return DEVICES


def nvmlDeviceGetHandleByIndex(index):
    if not 0 <= index < DEVICES:
        raise NVMLError("Invalid Argument")
    return index


def nvmlDeviceGetHandleByUUID(uuid):
    if not uuid.startswith("GPU-virtual-"):
        raise NVMLError("Not Found")
    return nvmlDeviceGetHandleByIndex(int(uuid.rpartition("-")[2]))


def nvmlDeviceGetUtilizationRates(handle):
    now, cpu = time.monotonic(), _learner_cpu_seconds()
    with _lock:
        then, cpu_then = _last.get(handle, (now, cpu))
        _last[handle] = (now, cpu)
    percent = 100.0 * max(0.0, cpu - cpu_then) / (now - then) if now > then else 0.0
    return SimpleNamespace(gpu=int(round(min(100.0, percent))), memory=0)


def nvmlDeviceGetMemoryInfo(handle):
    return SimpleNamespace(used=2**30, total=_TOTAL_BYTES, free=_TOTAL_BYTES - 2**30)


def nvmlDeviceGetPowerUsage(handle):
    return 50_000  # milliwatts


def nvmlDeviceGetComputeRunningProcesses(handle):
    return [SimpleNamespace(pid=pid, usedGpuMemory=2**30 // 2) for pid in procfs.descendants(os.getpid())[:1]]


def _learner_cpu_seconds():
    ticks = 0
    for pid in _learner_pids():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            ticks += sum(int(x) for x in stat[stat.rfind(b")") + 2:].split()[11:15])
        except (OSError, ValueError):
            continue  # ended meanwhile
    return ticks / _TICKS


def _learner_pids():
    """Every process below the process that loaded this module; or, where VIRTUAL_NVML_LEARNER_PID
    names one (a unit test, whose process has other children), that process and those below it."""
    named = os.environ.get("VIRTUAL_NVML_LEARNER_PID")
    if named:
        return [int(named), *procfs.descendants(int(named))]
    return procfs.descendants(os.getpid())
