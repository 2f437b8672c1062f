"""Safe handling of the code archives users upload (zip, tar, tar.gz).

The same rules run twice: the platform calls `inspect_archive` when a job is submitted, so a bad
archive is refused before anything is stored, and the learner agent calls `extract_archive` to unpack
the code. An archive is untrusted input, so both refuse anything that could write outside the target
(absolute paths, `..`, links), anything that isn't a plain file or directory, too many members, more
bytes than allowed, and paths the agent could not unpack or measure (`MAX_DEPTH`, `MAX_NAME_BYTES`,
`MAX_PATH_BYTES`), so such an archive is refused at submission rather than failing its job later.
Headers can lie (zip bombs), so extraction also counts the bytes it actually writes. Stdlib only: the
agent imports this.

Inspection runs inside the submit request, so it is bounded (`InspectBounds`): an archive may unpack to
at most `max_ratio` times its own size (past `RATIO_FREE_BYTES`), a .tar.gz is inflated only that far,
and never past a deadline. A member's declared size is checked before its data is read, so a bomb of
one huge member is refused after its first header, and one of many small members once the inflated
bytes pass the allowance: nothing is ever inflated whole.
"""
import contextlib
import gzip
import os
import re
import shutil
import stat
import struct
import tarfile
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass

from learner_agent import diskwatch

_CHUNK_BYTES = 1 << 20
_WINDOWS_DRIVE = re.compile(r"^[A-Za-z]:")
# What a broken or hostile compressed stream can raise while being read.
_CORRUPT_ERRORS = (tarfile.TarError, zipfile.BadZipFile, zlib.error, gzip.BadGzipFile, EOFError,
                   NotImplementedError)


# Folders an archive may nest: the agent fails a learner whose work folder nests deeper than it can
# measure (diskwatch.MAX_DEPTH).
MAX_DEPTH = diskwatch.MAX_DEPTH
MAX_NAME_BYTES = 255  # one name in a path (Linux's NAME_MAX)
# A member's whole path: Linux's PATH_MAX (4096) less room for the folder it is unpacked in.
MAX_PATH_BYTES = 3072
# What a message shows of a member's name: a tar header can give one of megabytes.
SHOWN_NAME_CHARS = 200


class ArchiveError(ValueError):
    """The archive breaks a rule; the message names the offending member when there is one."""

    def __init__(self, message, *, member=None):
        self.member = member
        super().__init__(f"archive member {shown(member)}: {message}" if member is not None else message)


def shown(name):
    """A member's name (or a link's target) for a message: quoted, cut short past SHOWN_NAME_CHARS."""
    if len(name) <= SHOWN_NAME_CHARS:
        return repr(name)
    return f"{name[:SHOWN_NAME_CHARS]!r}... ({len(name):,} characters)"


class ArchiveTooLarge(ArchiveError):
    """The archive unpacks to more bytes than allowed (declared by its headers, or actually written)."""


@dataclass(frozen=True)
class ArchiveInfo:
    kind: str  # "zip" | "tar" | "tar.gz"
    members: int  # files and directories
    files: int  # files alone: an archive of none has no code to run
    unpacked_bytes: int  # declared by the headers (inspect) or actually written (extract)


# Archives that unpack to no more than this are never refused for their ratio: a small archive of
# repetitive text compresses far better than code usually does, and inflating this much is cheap.
RATIO_FREE_BYTES = 16 * 1024 * 1024
# What a tar stream may hold beyond its members' data, per member allowed: its header block(s) and
# padding to the next 512-byte block.
_TAR_OVERHEAD_PER_MEMBER = 1024


@dataclass(frozen=True)
class InspectBounds:
    """How much reading one inspection may cost: `max_ratio` (unpacked bytes per archive byte, None: no
    limit) and `max_seconds` (None: no deadline)."""
    max_ratio: float | None = None
    max_seconds: float | None = None


def inspect_archive(path, *, max_unpacked_bytes, max_members, bounds=InspectBounds()):
    """Check an archive without unpacking it; raise ArchiveError when it breaks a rule.

    With `bounds`, stop reading as soon as the archive declares more than its ratio allows, inflates
    past that, or the deadline passes."""
    kind = detect_kind(path)
    allowed = _allowed_bytes(os.path.getsize(path), max_unpacked_bytes, bounds.max_ratio)
    deadline = time.monotonic() + bounds.max_seconds if bounds.max_seconds is not None else None
    budget = _ReadBudget(allowed + _TAR_OVERHEAD_PER_MEMBER * max_members, deadline, bounds.max_seconds)
    members = files = total = 0
    for entry in _entries(path, kind, max_unpacked_bytes=max_unpacked_bytes, max_members=max_members,
                          budget=budget):
        members += 1
        files += not entry.is_dir
        total += entry.size
        if total > allowed:  # a tighter limit than max_unpacked_bytes: the ratio's
            raise ArchiveError(_ratio_refusal(total, os.path.getsize(path), bounds.max_ratio), member=entry.name)
        budget.check_time()
    return ArchiveInfo(kind=kind, members=members, files=files, unpacked_bytes=total)


def _allowed_bytes(archive_bytes, max_unpacked_bytes, max_ratio):
    if max_ratio is None:
        return max_unpacked_bytes
    return min(max_unpacked_bytes, max(RATIO_FREE_BYTES, int(max_ratio * archive_bytes)))


def _ratio_refusal(unpacked, archive_bytes, max_ratio):
    return (f"archive unpacks to at least {_mib(unpacked)} from {_mib(archive_bytes)}: more than {max_ratio:g} "
            f"times its size, the limit for archives that unpack to over {_mib(RATIO_FREE_BYTES)} "
            "(an archive bomb?); refused without unpacking it")


def _mib(count):
    return f"{count / 2**20:.1f} MiB"


class _ReadBudget:
    """Counts what is read from an archive's decompressed stream, refusing past `max_bytes` or the
    deadline: what tarfile reads on its own (skipping data, extended headers) is bounded too."""

    def __init__(self, max_bytes, deadline, max_seconds):
        self.max_bytes, self.deadline, self.max_seconds = max_bytes, deadline, max_seconds
        self.read = 0

    def take(self, count):
        self.read += count
        if self.read > self.max_bytes:
            raise ArchiveError(f"archive inflates to more than {_mib(self.max_bytes)}, more than its size "
                               "allows (an archive bomb?); refused without unpacking the rest")
        self.check_time()

    def check_time(self):
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise ArchiveError(f"archive took more than {self.max_seconds:g}s to inspect; refused")


class _BudgetedReader:
    """A readable stream that charges every byte it returns to a _ReadBudget."""

    def __init__(self, raw, budget):
        self.raw, self.budget = raw, budget

    def read(self, size=-1):
        data = self.raw.read(size if size is not None and size >= 0 else _CHUNK_BYTES)
        self.budget.take(len(data))
        return data

    def close(self):
        self.raw.close()


def extract_archive(path, dest, *, max_unpacked_bytes, max_members):
    """Unpack into `dest` (which must not exist, or be an empty directory); all or nothing.

    The archive is unpacked into a fresh directory next to `dest` and renamed into place at the end,
    so a refused archive leaves nothing behind and nothing in the tree can be a pre-existing symlink.
    A single top-level directory in the archive is kept as it is.
    """
    dest = os.path.abspath(dest)
    if os.path.islink(dest):
        raise FileExistsError(f"{dest} is a symlink; refusing to unpack through it")
    if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
        raise FileExistsError(f"{dest} already exists and is not an empty directory")
    kind = detect_kind(path)
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.", suffix=".unpacking", dir=parent)
    try:
        info = _unpack(path, kind, staging, max_unpacked_bytes=max_unpacked_bytes,
                       max_members=max_members)
        os.chmod(staging, 0o755)
        if os.path.isdir(dest):
            os.rmdir(dest)  # empty, checked above; rename cannot replace it otherwise
        os.rename(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return info


def detect_kind(path):
    """"zip", "tar.gz" or "tar", from the file's first bytes (the name may say anything)."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(b"PK"):
        return "zip"
    if head.startswith(b"\x1f\x8b"):
        return "tar.gz"
    return "tar"


@dataclass(frozen=True)
class _Entry:
    name: str  # as written in the archive, for messages
    parts: tuple  # safe relative path components
    is_dir: bool
    size: int
    executable: bool
    open: object  # () -> readable binary file, for files


def _unpack(path, kind, root, *, max_unpacked_bytes, max_members):
    members = files = written = 0
    for entry in _entries(path, kind, max_unpacked_bytes=max_unpacked_bytes, max_members=max_members):
        members += 1
        files += not entry.is_dir
        target = os.path.join(root, *entry.parts)
        try:
            if entry.is_dir:
                os.makedirs(target, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            written = _write_file(entry, target, written, max_unpacked_bytes)
        except OSError as e:
            raise ArchiveError(f"cannot be unpacked: {e.strerror or e}", member=entry.name) from e
    return ArchiveInfo(kind=kind, members=members, files=files, unpacked_bytes=written)


def _write_file(entry, target, written, max_unpacked_bytes):
    """Copy one member, counting real bytes: a header that lies about the size changes nothing."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(target, flags, 0o755 if entry.executable else 0o644)
    with os.fdopen(fd, "wb") as out:
        try:
            with entry.open() as src:
                while chunk := src.read(_CHUNK_BYTES):
                    written += len(chunk)
                    if written > max_unpacked_bytes:
                        raise ArchiveTooLarge(
                            f"archive unpacks to more than {max_unpacked_bytes} bytes "
                            f"(the headers understate the size)", member=entry.name)
                    out.write(chunk)
        except _CORRUPT_ERRORS as e:
            raise ArchiveError(f"is corrupt: {e}", member=entry.name) from e
    return written


def _entries(path, kind, *, max_unpacked_bytes, max_members, budget=None):
    """Yield the archive's members as checked _Entry objects, enforcing count and declared size (and,
    with a _ReadBudget, the bytes a tar stream may inflate to)."""
    if kind == "zip":
        _check_zip_directory(path, max_members)
    source = _zip_entries(path) if kind == "zip" else _tar_entries(path, kind, budget)
    members = declared = 0
    for entry in source:
        if entry is None:  # the archive's own root ("./"): nothing to create
            continue
        members += 1
        if members > max_members:
            raise ArchiveError(f"archive has more than {max_members} members")
        declared += entry.size
        if declared > max_unpacked_bytes:
            raise ArchiveTooLarge(f"archive unpacks to more than {max_unpacked_bytes} bytes",
                                  member=entry.name)
        yield entry


# The zip records the central directory is found and walked by (APPNOTE 4.3.12, 4.3.14-16).
_END = struct.Struct("<4s4H2LH")
_END64_LOCATOR = struct.Struct("<4sLQL")
_END64 = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s24x3H12x")  # signature, then the name's, extra field's and comment's lengths


def _check_zip_directory(path, max_members):
    """Refuse a zip whose central directory holds more than `max_members` entries, counted before
    zipfile reads it: zipfile makes an object of every entry first, over a million for a 100 MiB zip of
    empty files (seconds and hundreds of MiB of one request, past any deadline). The directory is
    found as zipfile finds it; one that is not there is left to zipfile to refuse."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        tail_start = max(0, size - _END.size - 0xFFFF)  # the end record, then at most 64 KiB of comment
        f.seek(tail_start)
        tail = f.read()
        at = tail.rfind(b"PK\x05\x06", 0, len(tail) - _END.size + 4)
        if at < 0:
            return
        end = tail_start + at
        directory_bytes = _END.unpack_from(tail, at)[5]
        if end >= _END64_LOCATOR.size + _END64.size:
            f.seek(end - _END64_LOCATOR.size - _END64.size)
            record, locator = f.read(_END64.size), f.read(_END64_LOCATOR.size)
            if locator[:4] == b"PK\x06\x07" and record[:4] == b"PK\x06\x06":
                directory_bytes, end = _END64.unpack(record)[8], end - _END64_LOCATOR.size - _END64.size
        f.seek(max(0, end - directory_bytes))
        walked = entries = 0
        while walked < directory_bytes:
            header = f.read(_CENTRAL.size)
            if len(header) < _CENTRAL.size or header[:4] != b"PK\x01\x02":
                return  # not a central directory zipfile can read: it says so
            entries += 1
            if entries > max_members:
                raise ArchiveError(f"archive has more than {max_members} members")
            name, extra, comment = _CENTRAL.unpack(header)[1:]
            f.seek(name + extra + comment, os.SEEK_CUR)
            walked += _CENTRAL.size + name + extra + comment


def _zip_entries(path):
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise ArchiveError(f"not a valid zip archive: {e}") from e
    with zf:
        for info in zf.infolist():
            name = info.filename
            if info.flag_bits & 0x1:
                raise ArchiveError("is encrypted", member=name)
            file_type = stat.S_IFMT(info.external_attr >> 16) if info.create_system == 3 else 0
            if file_type not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise ArchiveError(_describe_file_type(file_type), member=name)
            is_dir = info.is_dir() or file_type == stat.S_IFDIR
            parts = _safe_parts(name, is_dir=is_dir)
            if parts is None:
                yield None
                continue
            yield _Entry(name=name, parts=parts, is_dir=is_dir, size=0 if is_dir else info.file_size,
                         executable=bool((info.external_attr >> 16) & 0o111),
                         open=lambda info=info: zf.open(info))


def _tar_entries(path, kind, budget=None):
    with contextlib.ExitStack() as opened:
        tf = opened.enter_context(_open_tar(path, kind, budget, opened))
        members = iter(tf)
        first = True
        while True:
            try:
                member = next(members)
            except StopIteration:
                return
            except _CORRUPT_ERRORS as e:
                # A stream is only read on demand, so a file that isn't a tar at all fails here.
                what = "not a zip or tar archive" if first else "archive is corrupt"
                raise ArchiveError(f"{what}: {e}") from e
            first = False
            name = member.name
            if member.issparse() or not (member.isreg() or member.isdir()):
                raise ArchiveError(_describe_tar_type(member), member=name)
            parts = _safe_parts(name, is_dir=member.isdir())
            if parts is None:
                yield None
                continue
            yield _Entry(name=name, parts=parts, is_dir=member.isdir(),
                         size=0 if member.isdir() else member.size,
                         executable=bool(member.mode & 0o111),
                         open=lambda member=member: tf.extractfile(member))


def _open_tar(path, kind, budget, opened):
    # Stream mode ("r|"): one forward pass. Random access into a .tar.gz would decompress from the
    # start for every member.
    try:
        if budget is None:
            return tarfile.open(path, "r|gz" if kind == "tar.gz" else "r|")
        # Decompressed here rather than by tarfile, so that every byte it reads is counted.
        raw = opened.enter_context(gzip.open(path, "rb") if kind == "tar.gz" else open(path, "rb"))
        return tarfile.open(fileobj=_BudgetedReader(raw, budget), mode="r|")
    except _CORRUPT_ERRORS as e:
        raise ArchiveError(f"not a zip or tar archive: {e}") from e


def _safe_parts(name, *, is_dir):
    """The member's path as components that stay inside the target, or None for the root itself."""
    if "\x00" in name:
        raise ArchiveError("path contains a NUL byte", member=name)
    # Zips written on Windows may use backslashes; treat them as separators so they are checked too.
    normalized = name.replace("\\", "/")
    if normalized.startswith("/") or _WINDOWS_DRIVE.match(normalized):
        raise ArchiveError("absolute path", member=name)
    parts = tuple(p for p in normalized.split("/") if p not in ("", "."))
    if ".." in parts:
        raise ArchiveError("path contains '..' (would write outside the target)", member=name)
    if not parts:
        if is_dir:
            return None
        raise ArchiveError("empty file name", member=name)
    _check_path_size(name, parts, is_dir=is_dir)
    return parts


def _check_path_size(name, parts, *, is_dir):
    folders = len(parts) if is_dir else len(parts) - 1
    if folders > MAX_DEPTH:
        raise ArchiveError(f"path nests {folders} folders deep; at most {MAX_DEPTH} are allowed", member=name)
    # surrogateescape: how tarfile reads a name that is not UTF-8, and how it is written back
    sizes = [len(part.encode("utf-8", "surrogateescape")) for part in parts]
    if max(sizes) > MAX_NAME_BYTES:
        raise ArchiveError(f"a name in its path is {max(sizes):,} bytes long; at most {MAX_NAME_BYTES} are allowed",
                           member=name)
    if sum(sizes) + len(sizes) - 1 > MAX_PATH_BYTES:
        raise ArchiveError(f"path is {sum(sizes) + len(sizes) - 1:,} bytes long; at most {MAX_PATH_BYTES} are "
                           "allowed", member=name)


def _describe_tar_type(member):
    if member.issym():
        return f"is a symbolic link (to {shown(member.linkname)}); links are not allowed"
    if member.islnk():
        return f"is a hard link (to {shown(member.linkname)}); links are not allowed"
    if member.ischr() or member.isblk():
        return "is a device file; only files and directories are allowed"
    if member.isfifo():
        return "is a FIFO; only files and directories are allowed"
    if member.issparse():
        return "is a sparse file; only plain files and directories are allowed"
    return "has an unsupported type; only files and directories are allowed"


def _describe_file_type(file_type):
    if file_type == stat.S_IFLNK:
        return "is a symbolic link; links are not allowed"
    return "is not a plain file or directory; only files and directories are allowed"
