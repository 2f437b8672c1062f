"""Byte sizes as people read them ("1.5 GiB"), for the client's output and the platform's own
messages alike: the one home of this formatting on the server and client side.

The learner agent keeps its own compact form (`learner_agent.agent.format_bytes`, "4.0GiB"): it is
copied alone into Kubernetes pods and runs on the framework image's Python, so it cannot import this
package; the Kubernetes backend uses the agent's form for the memory-limit reason, so both backends
word that reason the same way.
"""


def format_bytes(size):
    """1536 -> "1.5 KiB"; 0 -> "0 B"; None -> "-"."""
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
