"""Disk caps on a learner's folders, enforced by measuring them while it runs.

A folder on the machine's own filesystem has no size limit of its own: project quotas need a
filesystem mounted with them, a loop-mounted image per folder needs root and a file as large as the
cap made before the learner starts. So the agent measures each capped folder (`usage`: the blocks
its files take, walked with os.scandir and bounded in entries) every INTERVAL_S, and every
FAST_INTERVAL_S once it is past half its cap (a walk of a few files costs well under a millisecond),
and the learner is killed as soon as one is over, its exit reason naming the folder and the cap. What lies in results/ and checkpoints/ counts as the copies
storing the job's output makes of it (COPIED): a sparse file at its length, a hard link as one more
file. A writer gets past the cap by what it writes between two measurements (docs/submitting.md,
"Disk caps", has the figure measured here); RLIMIT_FSIZE (set by
learner_agent.launch at the largest cap) is the hard bound per file, and in the sandbox fallocate is
refused (learner_agent.launch), so space is taken no faster than it is written. A file the learner
deletes while keeping it open takes its blocks all the same, and no walk finds it: those on the
capped folders' disks (`deleted_bytes`, read through /proc/<pid>/fd of the learner's processes)
count against its work cap. /tmp and /dev/shm are not watched here: they are tmpfs mounts whose
size is their cap, and the kernel refuses writes past it.

Stdlib only: the agent imports this.
"""
import os
import stat
import time
from dataclasses import dataclass

from learner_agent.sizes import format_bytes

INTERVAL_S = 0.25
FAST_INTERVAL_S = 0.1
# Files and folders one measurement walks at most: more in one capped folder is itself over the cap
# (a million files is beyond any results or checkpoint folder, and takes the walk seconds).
MAX_ENTRIES = 1_000_000
# Folders nested deeper than this are over the cap: past PATH_MAX (a few dozen levels of long names) a
# path no longer reaches what lies below it, which a walk by path would count as nothing.
MAX_DEPTH = 64
# Open files of the learner's processes looked at in one measurement: holding more counts as over the
# work cap, since what lies past them could be deleted files that would count as nothing.
MAX_OPEN_FILES = 100_000


# Folders the platform copies whole when the job stores its output (recorded, pushed to the job's
# result stores): a copy writes a sparse file's holes as zeros and each hard link as a file of its own.
COPIED = ("results", "checkpoints")


@dataclass(frozen=True)
class Cap:
    name: str  # "results" | "checkpoints" | "work"
    limit: int  # bytes
    paths: tuple  # the folders counted together against it

    @property
    def copied(self):
        """Whether its files count as their copies will take: each name at its length."""
        return self.name in COPIED


@dataclass(frozen=True)
class Breach:
    cap: Cap
    used: int  # bytes measured (or the entries counted when too_many)
    too_many: bool = False
    unmeasurable: str = ""  # why the folder could not be measured whole: itself over the cap
    deleted: int = 0  # of `used`, bytes in files the learner deleted but keeps open

    @property
    def reason(self):
        if self.unmeasurable:
            return f"disk cap: the {self.cap.name} folder cannot be measured: {self.unmeasurable}; killed"
        if self.too_many:
            return (f"disk cap: the {self.cap.name} folder holds more than {MAX_ENTRIES} files and folders; "
                    f"killed")
        held = f" ({format_bytes(self.deleted)} in files it deleted but keeps open)" if self.deleted else ""
        return (f"disk cap: the {self.cap.name} folder used {format_bytes(self.used)}{held}, over its cap of "
                f"{format_bytes(self.cap.limit)}; killed")


class TooManyEntries(Exception):
    pass


class Unmeasurable(Exception):
    """A folder under a capped one cannot be walked (nested past MAX_DEPTH, unreadable): what lies
    below it would count as nothing, so the folder is over its cap."""


def usage(paths, *, max_entries=MAX_ENTRIES, copied=False):
    """Bytes the files and folders under `paths` take on disk (allocated blocks, each inode once,
    symlinks not followed); TooManyEntries past `max_entries`, Unmeasurable for a folder nested past
    MAX_DEPTH or one that cannot be read. A folder that is missing counts 0, and one that vanishes
    while being walked counts what was seen of it. `copied` (Cap.copied): each name of a file counts,
    at least at its length."""
    total = entries = 0
    seen_links = set()  # (device, inode) of files with more than one name: counted once
    stack = [(p, 0) for p in paths if os.path.isdir(p) and not os.path.islink(p)]
    while stack:
        folder, depth = stack.pop()
        try:
            with os.scandir(folder) as listing:
                for entry in listing:
                    entries += 1
                    if entries > max_entries:
                        raise TooManyEntries(entries)
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISDIR(info.st_mode):
                        if depth >= MAX_DEPTH:
                            raise Unmeasurable(f"its folders nest deeper than {MAX_DEPTH} levels")
                        stack.append((entry.path, depth + 1))
                    elif copied:
                        total += max(info.st_blocks * 512, info.st_size if stat.S_ISREG(info.st_mode) else 0)
                        continue
                    elif info.st_nlink > 1:
                        key = (info.st_dev, info.st_ino)
                        if key in seen_links:
                            continue
                        seen_links.add(key)
                    total += info.st_blocks * 512
        except (FileNotFoundError, NotADirectoryError):
            continue  # gone (or replaced by a file) while being walked
        except OSError as exc:  # unreadable (a mode-000 folder of a learner not run as root), too long a path
            raise Unmeasurable(f"a folder in it cannot be read ({exc.strerror or exc})") from None
    return total


def deleted_bytes(pids, caps):
    """Bytes the processes `pids` hold in regular files they deleted but keep open, on the disks of
    `caps`' folders (not /tmp's tmpfs, nor memory files), each file once."""
    disks = set()
    for path in (path for cap in caps for path in cap.paths):
        try:
            disks.add(os.stat(path).st_dev)
        except OSError:
            continue
    total, seen, looked = 0, set(), 0
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours to read
            continue
        looked += len(fds)
        if looked > MAX_OPEN_FILES:
            raise Unmeasurable(f"its processes hold more than {MAX_OPEN_FILES} open files")
        for fd in fds:
            try:
                info = os.stat(f"/proc/{pid}/fd/{fd}")  # the open file itself, deleted or not
            except OSError:
                continue
            key = (info.st_dev, info.st_ino)
            if stat.S_ISREG(info.st_mode) and info.st_nlink == 0 and info.st_dev in disks and key not in seen:
                seen.add(key)
                total += info.st_blocks * 512
    return total


def charged_for_deleted(caps):
    """The cap that files deleted but kept open count against: the work folder's, else the largest."""
    return next((cap for cap in caps if cap.name == "work"), max(caps, key=lambda cap: cap.limit, default=None))


def check(caps, *, max_entries=MAX_ENTRIES, pids=()):
    """(the first Breach or None, the largest share of its cap any folder uses). `pids`: the learner's
    processes, whose deleted but open files count too."""
    share = 0.0
    try:
        deleted = deleted_bytes(pids, caps) if pids and caps else 0
    except Unmeasurable as e:
        return Breach(charged_for_deleted(caps), 0, unmeasurable=str(e)), 1.0
    charged = charged_for_deleted(caps) if deleted else None
    for cap in caps:
        held = deleted if cap is charged else 0
        try:
            used = usage(cap.paths, max_entries=max_entries, copied=cap.copied) + held
        except TooManyEntries as e:
            return Breach(cap, e.args[0], too_many=True), 1.0
        except Unmeasurable as e:
            return Breach(cap, 0, unmeasurable=str(e)), 1.0
        if used > cap.limit:
            return Breach(cap, used, deleted=held), used / cap.limit
        share = max(share, used / cap.limit)
    return None, share


def watch(caps, stopped, *, interval=INTERVAL_S, fast_interval=FAST_INTERVAL_S, pids=lambda: ()):
    """Measure `caps` until one is over (returns its Breach) or the event `stopped` is set (None).
    `pids()`: the learner's processes now."""
    while not stopped.is_set():
        started = time.monotonic()
        breach, share = check(caps, pids=pids())
        if breach is not None:
            return breach
        # A folder of many files is measured less often: the walks take at most a fifth of a core.
        pause = max(fast_interval if share > 0.5 else interval, 4 * (time.monotonic() - started))
        stopped.wait(pause)
    return None


def file_size_limit(caps, tmp_bytes=None):
    """RLIMIT_FSIZE for the learner: no single file may grow past the largest cap it could count
    against (a file is in one folder, so one past the largest cap is past its own)."""
    limits = [cap.limit for cap in caps] + ([tmp_bytes] if tmp_bytes else [])
    return max(limits) if limits else None
