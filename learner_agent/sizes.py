"""Byte sizes in the agent's compact form ("4.0GiB"), in a module of their own so the Kubernetes
backend, which words a learner's memory-limit reason as the agent does, need not import the agent.
Stdlib only, like the rest of the agent."""


def format_bytes(n):
    """4294967296 → "4.0GiB", 200000000 → "190.7MiB"."""
    if n >= 2**30:
        return f"{n / 2**30:.1f}GiB"
    return f"{n / 2**20:.1f}MiB"
