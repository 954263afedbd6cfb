"""``FileTier``: page records as files in one directory, shared by processes.

Layout: ``<path>/<first two hex digits>/<32 hex digits of the hash>.kvp``, one
record (``kvpool.tiers.backend`` format) per file, plus ``<path>/.tmp/`` for
writes in progress.

- Atomic writes: a record is written to a temporary file and renamed over its
  final name (``os.replace``), so a reader sees either a whole record or none.
  There is no fsync: a file torn by a crash fails its checksum and reads as a
  miss, which is all a cache needs.
- Bounded size, least recently used out: a write or read sets the file's mtime
  (strictly increasing within a process, see ``_stamp``), and when the bytes
  this process knows of pass ``max_bytes`` it rescans the directory and
  deletes the oldest files until the total fits. A process rescans at its
  first write once ``scan_interval_s`` seconds have passed since its last scan,
  so other processes' writes are counted by its next write after that (writers
  that then go idle can leave the directory past the bound until one writes
  again). Only writes evict (building a tier only counts), and a record over
  this process's bound is a miss, kept: a reader with a smaller bound never
  deletes a writer's records. A disk that fills first (ENOSPC, a quota) has
  the oldest records evicted to make room for a write (``_write``).
- Shared directories: renames are atomic, a file deleted while another
  process reads it stays readable through the open descriptor (POSIX), and
  a file that vanishes between listing and reading is a miss. Nothing read is
  trusted (``decode`` plus the reader's checks), so a damaged or foreign file
  costs a miss, never a crash; a file that is not the intact record its name
  promises is deleted when read (only that file: see ``_drop``).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from kvpool._forksafe import INNER
from kvpool._forksafe import track as track_for_fork
from kvpool.errors import InvalidArgumentError
from kvpool.tiers.backend import HEADER_BYTES, PageRecord, TierBackend, decode, encode, header_promises
from kvpool.tiers.file_eviction import FileEviction
from kvpool.tiers.file_paths import (
    SUFFIX,
    check_same_file_system,
    directory,
    free_bytes,
    make_directory,
    open_record,
    same_file,
    same_record,
)
from kvpool.validate import is_int

__all__ = ["FileTier"]


class FileTier(FileEviction, TierBackend):
    """Page records as files under ``path``, at most ``max_bytes`` in all (see the module doc).

    Args:
        path: the directory (created if missing; ``~`` is the home directory; a relative
            path is resolved against the working directory when the tier is built).
        max_bytes: bound on the records' bytes (> 0).
        scan_interval_s: longest time between directory rescans while writing.

    Raises:
        InvalidArgumentError: a bad ``max_bytes`` or ``scan_interval_s``, or ``path`` is not a
            str or os.PathLike, is empty, starts with ``~`` of no known user, cannot be
            used as a directory, or has its ``.tmp`` on another file system.

    Counters: ``hits`` (intact records returned), ``misses`` (no file),
    ``rejected`` (a file that was not an intact record under its name),
    ``stored``, ``evicted``.
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int, *, scan_interval_s: float = 1.0) -> None:
        if not is_int(max_bytes) or max_bytes <= 0:
            raise InvalidArgumentError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.path = directory(path)
        self._max = int(max_bytes)
        interval = float("nan")
        if isinstance(scan_interval_s, (int, float, np.integer, np.floating)) \
                and not isinstance(scan_interval_s, (bool, np.bool_)):
            try:
                interval = float(scan_interval_s)
            except OverflowError:  # an int past float's range (10**400): OverflowError, untyped
                pass
        if not 0 <= interval < float("inf"):
            raise InvalidArgumentError(f"scan_interval_s must be a finite number of seconds >= 0, "
                                       f"got {scan_interval_s!r:.60}")
        self.scan_interval_s = interval
        make_directory(self.path)
        check_same_file_system(self.path)
        self._lock = threading.Lock()
        # Taken around counters and mtimes by any thread: held at a fork, it would stay
        # held in the child, whose first get or put would then wait forever.
        track_for_fork(self, "_lock", INNER)
        self.hits = self.misses = self.rejected = self.stored = self.evicted = 0
        self._used = 0
        self._last_scan = 0.0
        self._clock_ns = 0  # the last mtime this process set: see _stamp
        self._blocked_warned = False  # a directory at a record's name was reported: see _into_place
        # Counted only: a process that reads with a smaller bound than the writers must
        # not delete their records; its own writes apply its bound.
        self._scan_and_evict(evict=False)

    @property
    def max_bytes(self) -> int:
        return self._max

    @property
    def used_bytes(self) -> int:
        """The records' bytes as of this process's last scan plus its writes since."""
        return self._used

    def file_for(self, page_hash: int) -> Path:
        """Where the record of ``page_hash`` lives."""
        if not is_int(page_hash) or not 0 <= page_hash < 1 << 128:
            raise InvalidArgumentError(f"page_hash must be a 128-bit page hash, an int in [0, 2**128) "
                                       f"(page_key(hi, lo)), got {type(page_hash).__name__} {page_hash!r}")
        name = f"{int(page_hash):032x}"
        return self.path / name[:2] / (name + SUFFIX)

    def get(self, page_hash: int) -> PageRecord | None:
        f = self.file_for(page_hash)
        try:
            # Not blocking, not through a symlink, and then only a regular file: a FIFO at a
            # record's name made open() wait forever (holding DiskCache's lock), and a link
            # to /dev/zero passed the size test (0) and read without end. Foreign, so a
            # miss, and left where it is.
            with open_record(f) as fh:
                st = os.fstat(fh.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_size > self._max:
                    # Past this process's bound, so not read into memory; but another
                    # process with a larger bound may have written it: a miss here, kept
                    # for that one (not judged damaged unread).
                    with self._lock:
                        self.misses += 1
                    return None
                # Its size and one byte more: a file growing under the read is not a record
                # (records are renamed into place whole). Not max_bytes + 1, which read()
                # would allocate up front.
                data = fh.read(st.st_size + 1)
                if len(data) > st.st_size:
                    with self._lock:
                        self.misses += 1
                    return None
                rec = decode(data)
                if rec is None or rec.page_hash != int(page_hash):
                    # Not the record its name promises (torn, corrupted, renamed): drop it, so
                    # that the next put under this name is not skipped as already present;
                    # but only this very file (still open: its inode cannot be reused), not
                    # one a writer renamed over it since the read.
                    self._drop(f, lambda q: same_file(os.stat(q), st))
                    with self._lock:
                        self.rejected += 1
                    return None
        except OSError:  # absent, removed meanwhile, unreadable, a directory
            with self._lock:
                self.misses += 1
            return None
        self._stamp(f)  # recently used: evicted last
        with self._lock:
            self.hits += 1
        return rec

    def touch(self, page_hashes: list[int]) -> None:
        try:
            if isinstance(page_hashes, (str, bytes, bytearray, set, frozenset, dict)):
                # A str's characters, a set's or dict's arbitrary order: no use order to apply.
                raise TypeError
            hashes = list(page_hashes)
        except TypeError:
            raise InvalidArgumentError(f"page_hashes must be a list of page hashes, in use order (the last most "
                                       f"recently used), got {type(page_hashes).__name__} {page_hashes!r:.60}") from None
        for f in [self.file_for(h) for h in hashes]:  # all checked before any is stamped
            self._stamp(f)

    def __reduce__(self) -> tuple[Any, ...]:
        # Another process (multiprocessing, spawn) gets its own tier on the same directory
        # and bound, with its own counters, as if it had built it: the lock is per process.
        return (_rebuild, (str(self.path), self._max, self.scan_interval_s))

    def _stamp(self, f: Path) -> None:
        """Set ``f``'s mtime to now, strictly after every mtime this process set before:
        file times are coarse (a kernel tick), and eviction must see the order of calls."""
        with self._lock:
            t = self._clock_ns = max(time.time_ns(), self._clock_ns + 1000)
        try:
            os.utime(f, ns=(t, t))
        except OSError:
            pass

    def contains(self, page_hash: int) -> bool:
        # Only a regular file at the name whose header promises the record filed there, as
        # get() reads it: a directory or a symlink (another tool), or a file a crash left empty
        # or short (no fsync), is no record, and said present its page would never be stored
        # again while every lookup missed for good. (A put replaces any of them.) The header
        # alone: a flipped byte past it is get()'s checksum to find, and get() then drops it.
        f = self.file_for(page_hash)
        try:
            with open_record(f) as fh:
                st = os.fstat(fh.fileno())
                return stat.S_ISREG(st.st_mode) and header_promises(fh.read(HEADER_BYTES), st.st_size, page_hash)
        except OSError:
            return False

    def put(self, record: PageRecord) -> bool:
        if not isinstance(record, PageRecord):
            raise InvalidArgumentError(f"record must be a kvpool.tiers.PageRecord, got {type(record).__name__}")
        blob = encode(record)
        if len(blob) > self._max:
            return False
        final = self.file_for(record.page_hash)
        if not self._write(final, blob):
            return False
        with self._lock:
            self.stored += 1
            self._used += len(blob)
            due = self._used > self._max or time.monotonic() - self._last_scan > self.scan_interval_s
        if due:
            self._scan_and_evict()
        return True

    def _write(self, final: Path, blob: bytes) -> bool:
        """Write ``blob`` to ``final`` through a temporary file. A disk that fills before
        ``max_bytes`` (ENOSPC, a quota) has the least recently used records evicted to make
        room for this one, then one more try: else the writes that fail would stay failing,
        while records of chains whose first pages never fit kept the disk full."""
        for attempt in range(2):
            try:
                self._write_once(final, blob)
                return True
            except OSError as e:
                if attempt or e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    return False
                short = len(blob) - (free_bytes(self.path) if e.errno == errno.ENOSPC else 0)
                if short <= 0:
                    return False  # the disk has room now: not this tier's records to give up
                self._scan_and_evict(free=short, keep=final)
        return False

    def _write_once(self, final: Path, blob: bytes) -> None:
        tmp = self.path / ".tmp" / f"{final.stem}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            try:
                fh = open(tmp, "wb")  # closed by the with below
            except FileNotFoundError:
                # The directory was removed under a running process (a cache cleared by
                # hand): make it again, or every later write would fail.
                tmp.parent.mkdir(parents=True, exist_ok=True)
                fh = open(tmp, "wb")
            with fh:
                fh.write(blob)
            self._subdirectory(final.parent)
            self._into_place(tmp, final)
            self._stamp(final)
        except OSError:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise

    def _subdirectory(self, sub: Path) -> None:
        try:
            sub.mkdir(exist_ok=True)
        except FileExistsError:
            # A file (or a link to one) holds the two-hex directory's name: someone's data,
            # kept, and said once, as a directory at a record's name is (_into_place); every
            # record filed under it is refused until it is moved.
            self._say_blocked(sub, "is a file, not the directory of page records filed under it")
            raise

    def _say_blocked(self, where: Path, what: str) -> None:
        if not self._blocked_warned:
            self._blocked_warned = True
            warnings.warn(f"FileTier: {str(where)!r} {what}: the pages filed under that name cannot be "
                          f"stored until it is removed (said once per tier)", RuntimeWarning, stacklevel=5)

    def _into_place(self, tmp: Path, final: Path) -> None:
        try:
            os.replace(tmp, final)
            return
        except OSError:
            if not final.is_dir():
                raise
        # A directory holds the record's name. An empty one is debris and goes; one
        # with contents is someone's data: kept, and said once (the refused write is
        # counted by the caller, e.g. DiskCache's stats.write_failures).
        try:
            final.rmdir()
        except OSError:
            self._say_blocked(final, "is a directory, not a page record, and is not empty")
            raise
        os.replace(tmp, final)

    def remove(self, page_hash: int) -> None:
        try:
            self.file_for(page_hash).unlink()
        except OSError:
            pass

    def discard(self, record: PageRecord) -> None:
        if not isinstance(record, PageRecord):
            raise InvalidArgumentError(f"record must be the kvpool.tiers.PageRecord get() returned, "
                                       f"got {type(record).__name__}")
        self._drop(self.file_for(record.page_hash), lambda q: same_record(decode(q.read_bytes()), record))


def _rebuild(path: str, max_bytes: int, scan_interval_s: float) -> FileTier:
    return FileTier(path, max_bytes, scan_interval_s=scan_interval_s)
