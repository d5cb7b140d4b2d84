"""Write files and directories whole or not at all.

A reader (a resumed run, a serving stack, another rank) must never see half a file: everything is
written under a temporary name in the same directory, flushed to disk, and renamed into place
(``os.replace`` is atomic within a file system). A crash leaves at most a temporary that no reader
trusts (names start with ``.`` or end in ``.partial``) and that the next write replaces.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import tempfile
from typing import Any, Iterator


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".partial",
                               dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; outputs are meant to be read by others
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, data: Any, **dump_kwargs: Any) -> None:
    """``json.dump`` into ``path`` atomically (indent 2 unless told otherwise)."""
    dump_kwargs.setdefault("indent", 2)
    write_text_atomic(path, json.dumps(data, **dump_kwargs) + "\n")


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, replace: bool = False) -> Iterator[str]:
    """Yield an empty staging directory next to ``path``; when the block finishes, its content
    becomes ``path`` in one rename (``promote_directory``). On an error the staging directory is
    removed and ``path`` is untouched.

    ``replace``: an existing ``path`` is swapped out only after the new content is complete.
    Without it, ``path`` must not exist or be an empty directory.
    """
    path = os.path.abspath(os.fspath(path))
    parent, base = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    os.chmod(staging, 0o755)
    try:
        yield staging
        promote_directory(staging, path, replace=replace)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def staging_directory(path: str | os.PathLike) -> str:
    """A fresh, empty staging directory next to ``path`` with a fixed name (``.<name>.staging``),
    for a directory that several processes write before one promotes it
    (``promote_directory``); a leftover of a crashed write is removed first."""
    path = os.path.abspath(os.fspath(path))
    parent, base = os.path.split(path)
    staging = os.path.join(parent, f".{base}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging, mode=0o755)
    return staging


def promote_directory(staging: str | os.PathLike, path: str | os.PathLike, *,
                      replace: bool = False) -> None:
    """Make the complete directory ``staging`` (same file system) become ``path``, its files
    flushed first. With ``replace`` an existing ``path`` is exchanged with ``staging`` in one
    atomic step (Linux ``renameat2(RENAME_EXCHANGE)``) and the old one then deleted, so that at
    every moment ``path`` is the old or the new directory; where the file system cannot exchange,
    the old one is renamed aside first. Without ``replace``, ``path`` must not exist or be an
    empty directory (never merged into)."""
    staging, path = os.fspath(staging), os.path.abspath(os.fspath(path))
    parent, base = os.path.split(path)
    for root, _, names in os.walk(staging):
        for name in names:
            fsync_path(os.path.join(root, name))
    fsync_path(staging)
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise FileExistsError(f"{path} exists and is not a directory")
        if replace:
            if _exchange(staging, path):  # one step: staging now holds the old directory
                shutil.rmtree(staging, ignore_errors=True)
            else:  # two renames: a crash between them leaves the old one at .<name>.old-*
                retired = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
                os.replace(path, retired)  # onto the empty placeholder
                os.replace(staging, path)
                shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rmdir(path)  # raises if not empty: never merge into someone's directory
            os.replace(staging, path)
    else:
        os.replace(staging, path)
    fsync_path(parent)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: str, b: str) -> bool:
    """Swap two existing paths atomically; False where the system or file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a libc without it
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), b)
