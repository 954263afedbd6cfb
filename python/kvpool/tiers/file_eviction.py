"""``FileTier``'s deletions: ``_drop``, which deletes a file only if it is still the one
its caller judged (atomic against writers renaming a new record over it), and the rescan
that recounts the records' bytes and evicts the least recently used files past the bound
(``_scan_and_evict``). A mixin of ``FileTier`` (the module doc of
``kvpool.tiers.file_tier`` says when each runs)."""

from __future__ import annotations

import os
import secrets
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpool.tiers.file_paths import entries, entries_age, is_record_name, same_file, unlink

__all__ = ["FileEviction"]

# A temporary file this old belongs to a writer that died.
STALE_TMP_S = 600.0
# In the name of a file _drop renamed into .tmp.
DROP = ".drop."
# From this many files on, eviction leaves room for a sixteenth of the bound (_scan_and_evict).
HYSTERESIS_FILES = 256


class FileEviction:
    """Mixed into ``FileTier``; uses its directory, bound, lock and counters."""

    path: Path
    _max: int
    _lock: Any
    _used: int
    _last_scan: float
    evicted: int

    def _drop(self, f: Path, still_it: Callable[[Path], bool]) -> bool:
        """Delete ``f`` if it is still what the caller judged (``still_it``), else leave what
        is there. Atomic against writers renaming a new record over ``f``: the file is
        first renamed away, so the check and the delete see one file; a file that
        turns out to be a newer record is linked back (unless a still newer one took
        the name meanwhile). Readers see a miss during that."""
        q = self.path / ".tmp" / f"{f.stem}{DROP}{os.getpid()}.{secrets.token_hex(4)}"
        for attempt in range(2):
            try:
                os.rename(f, q)
                break
            except FileNotFoundError:
                if attempt or not f.exists():
                    return False  # gone already
                try:  # .tmp itself was removed (a cache cleared by hand)
                    q.parent.mkdir(parents=True, exist_ok=True)
                except OSError:
                    return False
            except OSError:
                return False
        try:
            ours = still_it(q)
        except OSError:
            ours = False
        if not ours:
            try:
                os.link(q, f)
            except FileExistsError:
                pass  # a newer record has the name: ours is older
            except OSError:
                # A file system without hard links: a rename, which would replace a record
                # written meanwhile, so only onto a free name. What is left (a write between
                # the check and the rename) replaces one record by another of its name: the
                # same page (the name is the chain hash of its tokens under the fingerprint),
                # and readers verify what they get, so a hit stays right (see docs/tiers.md).
                try:
                    if not os.path.lexists(f):
                        os.rename(q, f)
                except OSError:
                    pass
        unlink(q)
        return ours

    def _files(self) -> list[tuple[int, os.stat_result, Path]]:
        out: list[tuple[int, os.stat_result, Path]] = []
        now = time.time_ns()
        for sub in self.path.iterdir():
            if sub.name == ".tmp":
                for mtime, st, f in entries(sub):
                    # A file renamed here by _drop keeps its (old) mtime; its ctime is the rename.
                    age = now - (max(mtime, st.st_ctime_ns) if DROP in f.name else mtime)
                    if age > STALE_TMP_S * 1e9:
                        unlink(f)
                continue
            if sub.name.startswith(".tmp-probe.") and entries_age(sub, now) > STALE_TMP_S * 1e9:
                unlink(sub)  # a construction probe of a process that died right then
            elif is_record_name(sub.name) and sub.is_dir():
                # Regular files named as records only: a directory, FIFO or link at a record's
                # name is not one of the tier's records, so neither counted nor evicted (eviction
                # renamed a full directory into .tmp, where it stayed); nor is any other file
                # (a "backup/x.kvp" of the user's was counted against the bound and deleted).
                out.extend(t for t in entries(sub)
                           if is_record_name(sub.name, t[2].name) and stat.S_ISREG(t[1].st_mode))
        return out

    def _scan_and_evict(self, evict: bool = True, free: int = 0, keep: Path | None = None) -> None:
        """Recount the directory and delete the least recently used files past ``max_bytes``
        (only recount without ``evict``), and with ``free`` until that many bytes more are
        free (a disk that filled first), never ``keep`` (the record a write replaces)."""
        try:
            files = self._files()
        except OSError:
            return
        total = sum(st.st_size for _, st, _ in files)
        limit = min(self._max, total - free) if free else self._max
        if len(files) >= HYSTERESIS_FILES:
            # A full tier evicts a sixteenth more than it must: fitting exactly, it went past the
            # bound again at the next put and rescanned the whole directory at every put (a
            # store_new of a few pages took 0.75 s at 1,700 files). Small tiers fit exactly.
            limit -= self._max // 16
        evicted = 0
        if evict and total > limit:
            for _mtime, st, f in sorted(files, key=lambda t: t[0]):
                if total <= limit:
                    break
                if f == keep:
                    continue
                # Only the file the scan saw: one written or read since (a new inode or
                # mtime) is recent, and the next oldest goes instead.
                if self._drop(f, lambda q, seen=st: same_file(os.stat(q), seen, mtime=True)):
                    evicted += 1
                    total -= st.st_size
                elif not f.exists():
                    total -= st.st_size  # another process deleted it first
        with self._lock:
            self._used, self._last_scan = total, time.monotonic()
            self.evicted += evicted
