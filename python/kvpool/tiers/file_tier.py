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
  deletes the oldest files until the total fits. Each process
  rescans at least every ``scan_interval_s`` seconds while it writes, so
  other processes' writes are counted within that time.
- Shared directories: renames are atomic, a file deleted while another
  process reads it stays readable through the open descriptor (POSIX), and
  a file that vanishes between listing and reading is a miss. Nothing read is
  trusted (``decode`` plus the reader's checks), so a damaged or foreign file
  costs a miss, never a crash; a file that is not the intact record its name
  promises is deleted when read.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from pathlib import Path

import numpy as np

from kvpool.errors import InvalidArgumentError
from kvpool.tiers.backend import PageRecord, TierBackend, decode, encode
from kvpool.validate import is_int

__all__ = ["FileTier"]

SUFFIX = ".kvp"
# A temporary file this old belongs to a writer that died.
STALE_TMP_S = 600.0


class FileTier(TierBackend):
    """Page records as files under ``path``, at most ``max_bytes`` in all (see the module doc).

    Args:
        path: the directory (created if missing; a relative path is resolved against the
            working directory when the tier is built).
        max_bytes: bound on the records' bytes (> 0).
        scan_interval_s: longest time between directory rescans while writing.

    Raises:
        InvalidArgumentError: a bad ``max_bytes``, or ``path`` cannot be used as a directory.

    Counters: ``hits`` (intact records returned), ``misses`` (no file),
    ``rejected`` (a file that was not an intact record under its name),
    ``stored``, ``evicted``.
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int, *, scan_interval_s: float = 1.0) -> None:
        if not is_int(max_bytes) or max_bytes <= 0:
            raise InvalidArgumentError(f"max_bytes must be a positive int, got {max_bytes!r}")
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidArgumentError(f"path must be a str or os.PathLike directory, got {type(path).__name__}")
        try:
            # Absolute now: a relative path must not follow a later chdir (writes would
            # fail, reads miss, and eviction would scan another directory).
            self.path = Path(path).absolute()
        except TypeError as e:  # a PathLike that returns bytes
            raise InvalidArgumentError(f"path must name a directory as str: {e}") from None
        if not os.fspath(path):
            # Path("") is ".": the working directory, whose subdirectories eviction scans.
            raise InvalidArgumentError("path must name a directory, got an empty path "
                                       "(give the directory explicitly, '.' for the working directory)")
        self._max = int(max_bytes)
        if isinstance(scan_interval_s, (bool, np.bool_)) \
                or not isinstance(scan_interval_s, (int, float, np.integer, np.floating)) \
                or not 0 <= scan_interval_s < float("inf"):
            raise InvalidArgumentError(f"scan_interval_s must be a finite number of seconds >= 0, "
                                       f"got {scan_interval_s!r}")
        self.scan_interval_s = float(scan_interval_s)
        try:
            (self.path / ".tmp").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InvalidArgumentError(f"FileTier path {str(self.path)!r} cannot be used as a directory: {e}") from None
        self._lock = threading.Lock()
        self.hits = self.misses = self.rejected = self.stored = self.evicted = 0
        self._used = 0
        self._last_scan = 0.0
        self._clock_ns = 0  # the last mtime this process set: see _stamp
        self._scan_and_evict()

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
            blob = f.read_bytes()
        except OSError:  # absent, removed meanwhile, unreadable
            with self._lock:
                self.misses += 1
            return None
        rec = decode(blob)
        if rec is None or rec.page_hash != int(page_hash):
            # Not the record its name promises (torn, corrupted, renamed): drop it, so
            # that the next put under this name is not skipped as already present.
            _unlink(f)
            with self._lock:
                self.rejected += 1
            return None
        self._stamp(f)  # recently used: evicted last
        with self._lock:
            self.hits += 1
        return rec

    def touch(self, page_hashes: list[int]) -> None:
        for h in page_hashes:
            self._stamp(self.file_for(h))

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
        return self.file_for(page_hash).exists()

    def put(self, record: PageRecord) -> bool:
        if not isinstance(record, PageRecord):
            raise InvalidArgumentError(f"record must be a kvpool.tiers.PageRecord, got {type(record).__name__}")
        blob = encode(record)
        if len(blob) > self._max:
            return False
        final = self.file_for(record.page_hash)
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
            final.parent.mkdir(exist_ok=True)
            os.replace(tmp, final)
            self._stamp(final)
        except OSError:
            try:
                tmp.unlink()
            except OSError:
                pass
            return False
        with self._lock:
            self.stored += 1
            self._used += len(blob)
            due = self._used > self._max or time.monotonic() - self._last_scan > self.scan_interval_s
        if due:
            self._scan_and_evict()
        return True

    def remove(self, page_hash: int) -> None:
        try:
            self.file_for(page_hash).unlink()
        except OSError:
            pass

    def _files(self) -> list[tuple[int, int, Path]]:
        out: list[tuple[int, int, Path]] = []
        now = time.time()
        for sub in self.path.iterdir():
            if sub.name == ".tmp":
                for t in _entries(sub):
                    if now - t[0] / 1e9 > STALE_TMP_S:
                        _unlink(t[2])
                continue
            if sub.is_dir():
                out.extend(t for t in _entries(sub) if t[2].name.endswith(SUFFIX))
        return out

    def _scan_and_evict(self) -> None:
        """Recount the directory and delete the least recently used files past ``max_bytes``."""
        try:
            files = self._files()
        except OSError:
            return
        total = sum(size for _, size, _ in files)
        evicted = 0
        if total > self._max:
            for _mtime, size, f in sorted(files, key=lambda t: t[0]):
                if total <= self._max:
                    break
                if _unlink(f):
                    evicted += 1
                total -= size  # gone either way: another process may have deleted it first
        with self._lock:
            self._used, self._last_scan = total, time.monotonic()
            self.evicted += evicted


def _entries(d: Path) -> list[tuple[int, int, Path]]:
    """(mtime in ns, size, path) of the files in ``d``: ns, as float seconds would lose
    the order ``_stamp`` sets."""
    out: list[tuple[int, int, Path]] = []
    try:
        with os.scandir(d) as it:
            for e in it:
                try:
                    st = e.stat()
                except OSError:
                    continue
                out.append((st.st_mtime_ns, st.st_size, Path(e.path)))
    except OSError:
        pass
    return out


def _unlink(f: Path) -> bool:
    try:
        f.unlink()
        return True
    except OSError:
        return False
