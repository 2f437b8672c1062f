"""How the scheduler words things for people: positions, resource amounts, why a job waits.

A reason is shown to the tenant of the job it is about, so it never names another tenant, its
people or its jobs: a job of the same tenant is named (useful: "job X needs the GPUs"), any other
is only "a job of another tenant"."""

GIB = 2**30


def ordinal(n):
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


_PREFIXES = {}
_WAITING, _IN_QUEUE = "waiting: ", " in tenant queue; "  # a position prefix is _WAITING + "2nd" + _IN_QUEUE


def position_prefix(position):
    prefix = _PREFIXES.get(position)
    if prefix is None:
        prefix = f"{_WAITING}{ordinal(position)}{_IN_QUEUE}"
        if len(_PREFIXES) < 100_000:
            _PREFIXES[position] = prefix
    return prefix


def split_position(reason):
    """(position, the rest) of a reason that begins with position_prefix; (None, reason) otherwise."""
    head, sep, rest = reason.partition(_IN_QUEUE)
    number = head.removeprefix(_WAITING)[:-2]  # "523rd" -> "523"
    if sep and head.startswith(_WAITING) and number.isdigit():
        return int(number), rest
    return None, reason


def job_seen_by(viewer_tenant, workload, kind=""):
    """`workload` as the tenant `viewer_tenant` may see it named, e.g. with kind="higher-priority ":
    'higher-priority job X' for its own job, 'a higher-priority job of another tenant' otherwise, and
    'a private higher-priority job of this tenant' for one that not every member may see."""
    if workload.tenant != viewer_tenant:
        return f"a {kind}job of another tenant"
    if workload.private:
        return f"a private {kind}job of this tenant"
    return f"{kind}job {workload.job_id}"


def gib(memory_bytes):
    return f"{memory_bytes / GIB:.1f} GiB"


def gpus_text(count):
    return "1 GPU" if count == 1 else f"{count} GPUs"


def cpus_text(count):
    """'1 CPU', '0.5 CPU', '2 CPUs': CPUs are fractional; up to one is said in the singular."""
    return f"{count:g} CPU" if count <= 1 else f"{count:g} CPUs"


def learners_of(learners, gpus):
    """'4 GPUs' for one learner, '2 learners × 4 GPUs' for a distributed job."""
    each = gpus_text(gpus)
    return f"{learners} learners × {each}" if learners > 1 else each


def amount(dimension, value):
    if dimension == "memory_bytes":
        return gib(value)
    if dimension == "cpus":
        return f"{value:g}"
    return str(value)


DIMENSION_LABEL = {"gpus": "GPU", "cpus": "CPU", "memory_bytes": "memory"}


def quota_in_use(dimension, used, quota):
    return f"tenant {DIMENSION_LABEL[dimension]} quota {amount(dimension, used)}/{amount(dimension, quota)} in use"


def quantity(dimension, value):
    """'1 GPU', '0.5 CPU', '3.0 GiB of memory': an amount with its unit, in the right number."""
    if dimension == "memory_bytes":
        return f"{gib(value)} of memory"
    return cpus_text(value) if dimension == "cpus" else gpus_text(value)


def exceeds_quota(dimension, needed, quota):
    return (f"needs {quantity(dimension, needed)}, more than the tenant {DIMENSION_LABEL[dimension]} quota of "
            f"{amount(dimension, quota)}; it cannot start unless the tenant may borrow")
