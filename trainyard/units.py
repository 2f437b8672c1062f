"""Byte sizes as people read them ("1.5 GiB") and write them ("4GiB"), for the client's output, the
manifest and the operator's quota commands alike: the one home of both on the server and client side.

The learner agent keeps its own compact form (`learner_agent.sizes.format_bytes`, "4.0GiB"): it is
copied alone into Kubernetes pods and runs on the framework image's Python, so it cannot import this
package; the Kubernetes backend uses the agent's form for the memory-limit reason, so both backends
word that reason the same way.
"""
import re
from decimal import Decimal

# SPEC §2's units, then Kubernetes' quantity suffixes (M/G/T powers of 1000, Mi/Gi/Ti of 1024) and the
# terabyte forms, so a size written for a pod's limits is read the same way here.
MEMORY_UNITS = {"MB": 10**6, "MiB": 2**20, "GB": 10**9, "GiB": 2**30, "Gb": 10**9,
                "M": 10**6, "Mi": 2**20, "G": 10**9, "Gi": 2**30, "T": 10**12, "Ti": 2**40,
                "TB": 10**12, "TiB": 2**40}
UNITS_HELP = ("write a number and a unit: MB, GB, TB (or M, G, T) count in 1000s, MiB, GiB, TiB (or Mi, Gi, Ti) "
              "in 1024s (e.g. 4GiB)")
_MEMORY_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*")


def parse_memory_size(text):
    """'4GiB' -> 4294967296; ValueError for anything else: a unit of MEMORY_UNITS is required.
    Decimal, not float: 400 digits must come out as a (huge) int the caller can bound, never an
    OverflowError or a rounded infinity."""
    match = _MEMORY_SIZE.fullmatch(text) if isinstance(text, str) and len(text) <= 1000 else None
    if not match or match.group(2) not in MEMORY_UNITS:
        raise ValueError(UNITS_HELP)
    return int(Decimal(match.group(1)) * MEMORY_UNITS[match.group(2)])


def format_bytes(size):
    """1536 -> "1.5 KiB"; 0 -> "0 B"; None -> "-"."""
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
