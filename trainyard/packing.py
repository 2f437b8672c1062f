"""Code directory → archive: what the client uploads and what the portal's submit page sends for a
bundled example, packed by the same rules (no Django, no network).

Packing is the writing side only. Reading an uploaded archive — the untrusted side, with its limits
on links, paths, members and bytes — is `learner_agent.archive`, which the platform runs at submit and
the agent runs again when it unpacks; that is also the authoritative check of what the server accepts.
The quick checks here (an archive's extension and first bytes) only spare a pointless upload.
"""
import logging
import os
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass

from trainyard.errors import PackingError

log = logging.getLogger(__name__)
EXCLUDED_DIRS = frozenset({".git", "__pycache__", ".venv"})
EXCLUDED_SUFFIXES = (".pyc",)


@dataclass
class Upload:
    """An open binary file to send, with the name and content type the server expects."""
    fileobj: object
    filename: str
    content_type: str
    size: int


def code_upload(path, *, warn=None):
    """The code to send: a directory packed into a temporary .tar.gz, or a .zip/.tar.gz as it is.
    The caller closes `fileobj`. `warn(message)` hears about skipped entries (default: logging)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        packed = tempfile.TemporaryFile()
        pack_directory(path, packed, warn=warn)
        return Upload(packed, "code.tar.gz", "application/gzip", _size(packed))
    if not os.path.exists(path):
        raise PackingError(f"{path}: no such file or directory")
    lowered = path.lower()
    if lowered.endswith(".zip"):
        if not zipfile.is_zipfile(path):
            raise PackingError(f"{path}: not a zip archive")
        opened = open(path, "rb")
        return Upload(opened, "code.zip", "application/zip", _size(opened))
    if lowered.endswith((".tar.gz", ".tgz")):
        opened = open(path, "rb")
        if opened.read(2) != b"\x1f\x8b":
            opened.close()
            raise PackingError(f"{path}: not a gzip-compressed tar archive")
        return Upload(opened, "code.tar.gz", "application/gzip", _size(opened))
    raise PackingError(f"{path}: the code must be a directory, a .zip or a .tar.gz archive")


def _size(fileobj):
    size = fileobj.seek(0, os.SEEK_END)
    fileobj.seek(0)
    return size


def pack_directory(root, out, *, warn=None):
    """Write root's tree as a tar.gz into the binary file `out`, skipping caches and VCS folders.

    The platform accepts no links in archives, so symlinks that stay inside the tree are stored as
    copies of what they point to; a symlink that leads outside the tree is refused (it would pack
    whatever it points to, e.g. a home directory), and so is one that loops back to its own parent.
    Hard links are stored as copies too.
    """
    root_real = os.path.realpath(root)
    # dereference: every path added is already resolved, so all it changes is that a file with a second
    # name in the tree is stored again rather than as a hard link to the first.
    with tarfile.open(fileobj=out, mode="w:gz", format=tarfile.PAX_FORMAT, dereference=True) as tar:
        _pack_tree(tar, root_real, "", root_real, frozenset({root_real}), warn or log.warning)
        if not any(member.isfile() for member in tar.getmembers()):
            # The platform refuses such an archive too; saying so here names the folder.
            raise PackingError(f"{root}: holds no files to send (caches and version control folders are "
                               "left out); the code folder is where the job's command runs")
    out.seek(0)


def _pack_tree(tar, folder, arc_folder, root_real, ancestors, warn):
    with os.scandir(folder) as scan:
        entries = sorted(scan, key=lambda entry: entry.name)
    for entry in entries:
        arcname = f"{arc_folder}{entry.name}"
        real = entry.path
        if entry.is_symlink():
            real = os.path.realpath(entry.path)
            if os.path.commonpath([root_real, real]) != root_real:
                raise PackingError(f"{arcname}: symlink points outside the code directory "
                                   f"(to {os.readlink(entry.path)}); copy what it needs into the directory")
            if not os.path.exists(real):
                warn(f"skipping {arcname}: broken symlink")
                continue
        if os.path.isdir(real):
            if entry.name in EXCLUDED_DIRS:
                continue
            if real in ancestors:
                raise PackingError(f"{arcname}: symlink loops back to one of its parent directories")
            tar.add(real, arcname=arcname, recursive=False, filter=_anonymous)
            _pack_tree(tar, real, arcname + "/", root_real, ancestors | {real}, warn)
        elif os.path.isfile(real):
            if not entry.name.endswith(EXCLUDED_SUFFIXES):
                tar.add(real, arcname=arcname, filter=_anonymous)
        else:
            warn(f"skipping {arcname}: not a regular file or directory")


def _anonymous(info):
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info
