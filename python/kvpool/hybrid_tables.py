"""HybridTables: the request-to-token table rows a hybrid ``KVPool``'s request operations
(``kvpool.hybrid_ops``) owe the core on a device pool, whose tables the core cannot write: an
extend's or admit's new slots, the null page's slots where a sliding window released pages, and
a sliding group's rows after a truncate. A mixin of ``HybridKVPool``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool.kernels import write_req_to_token
from kvpool.staging import pool_to_device

__all__ = ["HybridTables"]


class HybridTables:
    """The table-writing half of ``HybridKVPool``'s request operations."""

    # HybridKVPool's state these read (made by its __init__).
    allocator: Any
    groups: list[Any]
    _tables: list[Any]
    _tables_np: list[np.ndarray | None] | None
    _nulled: dict[int, np.ndarray]
    _sync_rows: Any  # (HybridCopies')

    def _scatter(self, handles: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                 slots: list[np.ndarray]) -> None:
        rows = self.allocator.rows(handles)
        for g, s in zip(self.groups, slots):
            table = self._tables[g.index]
            if table is not None:
                write_req_to_token(table, *self._on_device(rows, starts, counts, s))

    def _on_device(self, *parts: Any) -> list[torch.Tensor]:
        """Int64 copies of host arrays on the pool's device, with ONE copy through the pool's
        pinned ring on CUDA (``kvpool.staging.pool_to_device``): from pageable memory each
        copy would wait for the device. The ring keeps each buffer until its copy has run."""
        return pool_to_device(self, *(np.asarray(a, dtype=np.int64).reshape(-1) for a in parts))

    def _null_released(self, handles: np.ndarray, starts: np.ndarray) -> None:
        """Off the CPU: the null page's slots (``position % page_size``) where a sliding
        window released pages, as the core writes them into CPU tables in the same call.
        The extend from ``starts`` released every page wholly before ``starts - window + 1``;
        each row's nulls are written once, from where the last ones ended."""
        rows = self.allocator.rows(handles)
        for g in self.groups:
            done = self._nulled.get(g.index)
            if done is None or self._tables[g.index] is None:
                continue
            ps = g.page_size
            to = np.maximum(starts - (g.window - 1), 0) // ps * ps
            todo = to > done[rows]
            if not todo.any():
                continue
            r, end = rows[todo], to[todo]
            start = done[r]
            pos = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in zip(start.tolist(), end.tolist())])
            write_req_to_token(self._tables[g.index], *self._on_device(r, start, end - start, pos % ps))
            done[r] = end

    def _forget_nulled(self, handles: np.ndarray) -> None:
        """Rows (re)opened: their tables are rewritten from position 0 (``_null_released``)."""
        if self._nulled and len(handles):
            rows = self.allocator.rows(np.asarray(handles, dtype=np.int64).reshape(-1))
            for done in self._nulled.values():
                done[rows] = 0

    def _rewrite_windows(self, handles: Any) -> None:
        """Sliding groups' table rows after a truncate, which may have taken window pages
        the rows had released back from the cache: their positions read as the null page
        in the tables until rewritten."""
        sliding = [g for g in self.groups if g.kind == "sliding"]
        h = np.asarray(handles, dtype=np.int64).reshape(-1)
        if not sliding or not h.size:
            return
        self._forget_nulled(h)
        for g in sliding:
            if self._tables_np is not None:
                self.allocator.fill_table(h, self._tables_np[g.index], g.index)
            else:
                self._sync_rows(h, g)
