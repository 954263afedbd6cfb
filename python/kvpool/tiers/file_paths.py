"""File-system helpers of ``FileTier``: the records' file suffix, the directory argument,
the probe that ``.tmp`` can rename into the records' directory, directory listings with
their mtimes, free space, identity tests of files and records, and opening a record to
read it."""

from __future__ import annotations

import errno
import os
import re
import secrets
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.errors import InvalidArgumentError
from kvpool.tiers.backend import PageRecord

__all__ = ["check_same_file_system", "directory", "entries", "entries_age", "free_bytes", "is_record_name",
           "make_directory", "open_record", "same_file", "same_record", "unlink"]

# The end of a record's file name (FileTier.file_for): the eviction scan counts only such files.
SUFFIX = ".kvp"
# A record's subdirectory and file name, as FileTier.file_for makes them: the scan counts and
# evicts only files named so (another tool's "x.kvp", or one in "backup/", is not the tier's).
_SUBDIR = re.compile(r"[0-9a-f]{2}\Z")
_NAME = re.compile(r"[0-9a-f]{32}" + re.escape(SUFFIX) + r"\Z")


def is_record_name(subdir: str, name: str | None = None) -> bool:
    """Whether ``subdir`` (and ``name`` in it) is where ``FileTier.file_for`` files a record."""
    if not _SUBDIR.match(subdir):
        return False
    return name is None or (_NAME.match(name) is not None and name.startswith(subdir))

# How a record is opened to be read (see FileTier.get): not blocking (a FIFO), not through a link.
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)


def open_record(f: Path) -> Any:
    """``f`` opened to be read, with ``READ_FLAGS``. A directory there opens too, and
    ``open(fd)`` then raises without closing the descriptor it was given (one leaked on every
    look at a page whose name a directory holds): such an fd is closed here before the error."""
    fd = os.open(f, READ_FLAGS)
    try:
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise



def free_bytes(path: Path) -> int:
    """Bytes an unprivileged write can still take on ``path``'s file system (0 if unknown)."""
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):  # (no statvfs on Windows)
        return 0
    return st.f_bavail * st.f_frsize


def directory(path: Any) -> Path:
    """``path`` as an absolute directory path, ``~`` expanded."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"path must be a str or os.PathLike directory, got {type(path).__name__}")
    try:
        raw = os.fspath(path)
    except TypeError as e:  # a PathLike whose __fspath__ returns neither str nor bytes
        raise InvalidArgumentError(f"path must name a directory as str: {e}") from None
    if not isinstance(raw, str):  # a PathLike that returns bytes
        raise InvalidArgumentError(f"path must name a directory as str, got {type(raw).__name__} {raw!r:.60}")
    if "\0" in raw:  # (the file system calls would raise ValueError: embedded null byte)
        raise InvalidArgumentError(f"path {raw!r:.80} holds a NUL character, which no directory name can")
    if not raw:
        # Path("") is ".": the working directory, whose subdirectories eviction scans.
        raise InvalidArgumentError("path must name a directory, got an empty path "
                                   "(give the directory explicitly, '.' for the working directory)")
    full = os.path.expanduser(raw)
    if full.startswith("~"):
        # Else a directory literally named "~user" would be made in the working directory.
        raise InvalidArgumentError(f"path {raw!r} starts with '~' but names no user's home directory; give a "
                                   f"path under an existing user's home ('~/...' or '~user/...') or without '~'")
    # Absolute now: a relative path must not follow a later chdir (writes would fail,
    # reads miss, and eviction would scan another directory).
    return Path(full).absolute()


def make_directory(path: Path) -> None:
    """Create ``path`` and its ``.tmp`` (and missing parents); ``InvalidArgumentError`` if that
    fails, after removing the directories this call created: a refused tier leaves nothing
    on disk (a name too long for the file system failed after its parents were made)."""
    created = []
    p = path
    while not os.path.lexists(p) and p != p.parent:  # deepest first
        created.append(p)
        p = p.parent
    try:
        (path / ".tmp").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        for d in created:
            if not os.path.isdir(d):  # (Path.is_dir raises on a name too long)
                continue  # not made (the name the mkdir failed on)
            try:
                d.rmdir()
            except OSError:
                break  # not made here, or someone else's since: kept, and so are its parents
        raise InvalidArgumentError(f"FileTier path {str(path)!r} cannot be used as a directory: {e}") from None


def check_same_file_system(path: Path) -> None:
    """Refuse a ``.tmp`` that records cannot be renamed out of (a mount or a link to another
    file system): every write would fail. Probed by a rename, which also sees bind mounts of
    one file system (same device, still EXDEV). Any other failure (a read-only directory, a
    reader's) is left to the writes."""
    name = f"probe.{os.getpid()}.{secrets.token_hex(4)}"
    tmp, there = path / ".tmp" / name, path / f".tmp-{name}"
    try:
        tmp.touch(exist_ok=False)
    except OSError:
        return
    try:
        os.rename(tmp, there)
    except OSError as e:
        unlink(tmp)
        if e.errno == errno.EXDEV:
            raise InvalidArgumentError(
                f"FileTier path {str(path)!r}: its {str(path / '.tmp')!r} is on another file system, and "
                f"records are written there and renamed into place, which cannot cross file systems; "
                f"make .tmp a plain directory of {str(path)!r} (no mount or link to elsewhere)") from None
        return
    unlink(there)


def same_file(now: os.stat_result, seen: os.stat_result, mtime: bool = False) -> bool:
    return (now.st_dev, now.st_ino) == (seen.st_dev, seen.st_ino) and (
        not mtime or now.st_mtime_ns == seen.st_mtime_ns)


def same_record(a: PageRecord | None, b: PageRecord) -> bool:
    return a is not None and (a.page_hash, a.parent_hash, a.salt, a.fingerprint, bytes(a.payload)) == (
        b.page_hash, b.parent_hash, b.salt, b.fingerprint, bytes(b.payload)) and np.array_equal(a.tokens, b.tokens)


def entries(d: Path) -> list[tuple[int, os.stat_result, Path]]:
    """(mtime in ns, stat, path) of the files in ``d``: ns, as float seconds would lose
    the order ``_stamp`` sets."""
    out: list[tuple[int, os.stat_result, Path]] = []
    try:
        with os.scandir(d) as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                out.append((st.st_mtime_ns, st, Path(e.path)))
    except OSError:
        pass
    return out


def entries_age(f: Path, now: int) -> int:
    try:
        return now - f.stat().st_mtime_ns
    except OSError:
        return 0


def unlink(f: Path) -> bool:
    try:
        f.unlink()
        return True
    except OSError:
        return False
