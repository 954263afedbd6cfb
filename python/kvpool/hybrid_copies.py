"""HybridCopies: a hybrid pool runs the copies its core queued, and rewrites tables.

Copy-on-write of shared pages (every layer's K and V), a state group's zeroing,
fork and checkpoint copies, and on a device pool the table rows the core cannot
write itself. A mixin of ``HybridKVPool`` (kept apart so hybrid.py holds
construction and geometry).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.hybrid_plan import LayerGroup
from kvpool.kernels import copy_slots, write_req_to_token

__all__ = ["HybridCopies"]


class HybridCopies:
    """The queued-copy half of ``HybridKVPool``."""

    allocator: Any
    groups: list[LayerGroup]
    copied_slots: int
    _unrun: tuple[tuple[LayerGroup, np.ndarray, np.ndarray], ...] = ()  # copies taken whose run failed
    _storage: Any
    _states: Any
    _tables: Any
    _tables_np: Any
    _order: Any
    _on_device: Any
    _forget_nulled: Any

    def _run_copies(self, handles: Any = None) -> None:
        """Run every group's queued copies (before anything writes the group again).

        Page groups: copy-on-write of every layer's K and V. State groups: each
        pair copies every state tensor's row ``src`` to ``dst``; ``src = -1``
        zeroes ``dst`` (a new request starts from the empty state). On a device
        pool the core cannot write the tables, so the rows of ``handles`` are
        rewritten from the core when a page group moved some of their slots.
        """
        alloc = self.allocator
        # Copies taken from the core whose run failed go first: the core's queue no longer
        # has them, and a roll-back that keeps a private copy needs its bytes.
        work, self._unrun = list(self._unrun), ()
        for g in self.groups:
            if alloc.pending_copies(g.index):
                src, dst = alloc.take_copies(g.index)
                if src.shape[0]:
                    work.append((g, src, dst))
        for i, (g, src, dst) in enumerate(work):
            try:
                self._copy(g, src, dst, handles)
            except BaseException:
                self._unrun = tuple(work[i:])
                raise
        if work and self._order is not None:  # later hand-outs on other streams wait for these
            self._order.copied()

    def _copy(self, g: LayerGroup, src: np.ndarray, dst: np.ndarray, handles: Any) -> None:
        if g.kind != "state":
            st = self._storage[g.index]
            assert st is not None
            s, d = self._on_device(src, dst)
            copy_slots(st.flat[0] + st.flat[1], s, d)
            self.copied_slots += int(src.shape[0])
            if self._tables_np is None and handles is not None:
                self._sync_rows(np.asarray(handles, dtype=np.int64).reshape(-1), g)
            return
        states = self._states[g.index]
        assert states is not None
        live = src >= 0
        s, d, z = self._on_device(src[live], dst[live], dst[~live])
        for t in states.values():
            if s.shape[0]:
                t.index_copy_(0, d, t.index_select(0, s))  # the core never reads a slot it writes
            if z.shape[0]:
                t.index_fill_(0, z, 0)

    def _sync_rows(self, handles: np.ndarray, g: LayerGroup) -> None:
        """Write each request's slots of page group ``g`` into its table row (device pools)."""
        table = self._tables[g.index]
        assert table is not None
        if handles.shape[0] == 0:
            return
        parts = [self.allocator.slots(int(h), g.index) for h in handles]
        counts = np.array([p.shape[0] for p in parts], dtype=np.int64)
        rows = self.allocator.rows(handles)
        write_req_to_token(table, *self._on_device(rows, np.zeros_like(counts), counts, np.concatenate(parts)))

    def _write_new_rows(self, handles: np.ndarray) -> None:
        """Tables of requests that got slots without an extend (fork, prefix hit)."""
        self._forget_nulled(handles)
        for g in self.groups:
            if g.kind == "state":
                continue
            if self._tables_np is not None:
                table = self._tables_np[g.index]
                assert table is not None
                self.allocator.fill_table(handles, table, g.index)
            else:
                self._sync_rows(handles, g)
