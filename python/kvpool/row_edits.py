"""The pool's count of calls that change requests behind a consumer's back.

A consumer that keeps its requests' length, pages or table across steps (``KVPoolCache``
keeps its rows' page table while they share no page, and counts their tokens itself)
must learn when a pool call it did not make changed them: ``fork`` and ``swap_in``
share or move their pages, ``truncate`` shortens them, ``swap_out`` takes them off the
device, ``close`` and ``reset`` end them. Each such call counts here, with the handles
it named (the last ``KEEP`` calls), so a consumer compares one int per step and looks
further only when it moved. ``extend``, ``cache`` and ``evict`` are not counted: the
consumer's own steps extend, and a request's pages stay where they are when they are
published or when cached pages nobody holds are evicted.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

__all__ = ["RowEdits", "lengths_before"]

KEEP = 64


class RowEdits:
    """Mixin of ``KVPool`` and ``HybridKVPool`` (``_init_row_edits`` runs at construction)."""

    _row_edits: int  # calls counted so far (set under the pool's lock)
    _edited_rows: deque[tuple[int, np.ndarray | None]]  # (count after the call, its handles; None: all)

    def _init_row_edits(self) -> None:
        self._row_edits = 0
        self._edited_rows = deque(maxlen=KEEP)

    def _note_edit(self, handles: Any) -> None:
        """Count a call that changed ``handles`` (None: every request); under the pool's lock,
        after the call succeeded (a refused call changed nothing)."""
        self._row_edits += 1
        named = None if handles is None else np.array(handles, dtype=np.int64).reshape(-1)
        self._edited_rows.append((self._row_edits, named))

    def _edited_since(self, seen: int, handles: np.ndarray) -> bool:
        """Whether a call counted after ``seen`` named one of ``handles``, or every request
        (``reset``), or is too far back to tell."""
        now = self._row_edits
        since = [h for n, h in list(self._edited_rows) if n > seen]
        if len(since) < now - seen:
            return True
        return any(h is None or np.isin(handles, h).any() for h in since)


def lengths_before(allocator: Any, handles: Any, counts: Any) -> np.ndarray:
    """The lengths a committed extend started from (its lengths now less its counts: a count
    for each request, or one for all), for a roll-back of a CPU path, which keeps no packed
    ``starts`` (plain and hybrid pools alike)."""
    hs = np.asarray(handles, dtype=np.int64).reshape(-1)
    c = np.asarray(counts, dtype=np.int64).reshape(-1)
    return allocator.lengths(hs) - np.broadcast_to(c, hs.shape)
