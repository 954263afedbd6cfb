"""The batch rows' pages, kept step by step, and each layer's K/V for attention.

``KVPoolCache`` hands attention ``[batch, kv_heads, tokens, head_dim]`` K/V. The rows'
tokens live in whole pages of the pool, so this keeps a host page table of the
batch (``[B, pages]``) and presents K/V in one of two ways:

- **views, no copy**, when every row's pages are consecutive in the pool and the
  rows start equally far apart (one request on a pool whose free pages come in
  order, the common case at batch 1): a strided view of the layer's cache;
- **a page gather** otherwise: one ``index_select`` of whole pages per cache into a
  staging buffer the cache keeps, seen as ``[B, H, L, D]`` through a transpose.

Attention (SDPA on CPU, and on CUDA) reads both as well as a contiguous tensor.
While the rows share no page (no prefix hit, no fork) a page never changes under
a row, so the table grows by the new pages of each step; otherwise it is read
again from the allocator (``page_table``) at every step.

What attention gets is valid until the next ``update`` of any layer: the staging
buffer is shared by the layers, as one layer's attention runs before the next
layer stores its K/V.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool.modes import persistent


class StepPages:
    """Page table of a batch and the K/V views of its current step (non-fp8 pools)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.page = int(pool.page_size)
        self.h, self.d = int(pool.num_kv_heads), int(pool.head_dim)
        self.row = self.page * self.h * self.d  # elements of one page of one layer
        self.device = torch.device(pool.device)
        # Each layer's caches, token-major [num_slots, H, D] and by page [num_pages, page * H * D].
        self.flat = [(k.reshape(-1, self.h, self.d), v.reshape(-1, self.h, self.d))
                     for k, v in zip(pool.k_buffers, pool.v_buffers)]
        self.paged = [(k.view(-1, self.row), v.view(-1, self.row)) for k, v in self.flat]
        layers, num_pages = len(self.flat), self.paged[0][0].shape[0]
        # KVPool keeps every layer's K, then every layer's V, back to back in one allocation.
        # Then one strided view covers every layer's K and V (the views path), and every
        # page of every cache is a row of one [2 * layers * num_pages, page * H * D] view
        # (the gather path: one index_select per layer for K and V together).
        self.layer_step = _even_spacing([k for k, _ in self.flat] + [v for _, v in self.flat])
        self.all_pages: torch.Tensor | None = None
        self._page_offsets: np.ndarray | None = None
        if self.layer_step == num_pages * self.row:
            k0 = self.flat[0][0]
            self.all_pages = k0.as_strided((2 * layers * num_pages, self.row), (self.row, 1), k0.storage_offset())
            # Row of page p of layer l's K (l * num_pages + p) and V ((layers + l) * num_pages + p).
            self._page_offsets = ((np.arange(layers)[:, None] + np.array([0, layers])) * num_pages)[..., None]
        self._to_device = getattr(pool, "_to_device", None)
        self.table = np.zeros((0, 0), dtype=np.int64)
        self.npages = 0
        self.length = 0
        self.private = True
        # Gather path: per layer, the rows of its K pages then V pages in all_pages; or
        # (without all_pages) one [B * pages] index of page ids used for every cache.
        self._index: Any = None
        self._rows = 0  # pages gathered per cache
        self._strided: tuple[int, int] | None = None  # (first page, pages between rows) for views
        self._stage: torch.Tensor | None = None
        self._out: tuple[Any, Any] | None = None

    def reset(self, batch: int, *, private: bool) -> None:
        """Rows opened or reordered: the next step reads the table from the allocator."""
        self.table = np.zeros((batch, 0), dtype=np.int64)
        self.npages, self.length, self.private = 0, -1, private
        self._index = self._strided = self._out = None

    def advance(self, handles: np.ndarray, before: int, length: int, slots: np.ndarray) -> None:
        """The rows went from ``before`` to ``length`` tokens; ``slots`` are the new ones, row-major."""
        b, p = handles.shape[0], self.page
        npages = -(-length // p)
        if not self.private or self.length != before:
            _, indices, _ = self.pool.allocator.page_table(handles)
            self._set_table(np.asarray(indices, dtype=np.int64).reshape(b, npages))
        elif npages != self.npages:
            # A page starts at each position that is a multiple of the page size.
            new = slots.reshape(b, length - before)[:, (-before) % p :: p] // p
            if self.table.shape[1] < npages:
                grown = np.zeros((b, max(npages, 2 * self.table.shape[1], 8)), dtype=np.int64)
                grown[:, : self.npages] = self.table[:, : self.npages]
                self.table = grown
            self.table[:, self.npages : npages] = new
            self._set_table(None, npages)
        self.length = length
        self._out = None

    def _set_table(self, table: np.ndarray | None, npages: int | None = None) -> None:
        if table is not None:
            self.table, npages = table, table.shape[1]
        assert npages is not None
        self.npages = npages
        t = self.table[:, :npages]
        self._strided = _strided(t)
        self._index = None
        if self._strided is not None:
            return
        self._rows = t.size
        if self._page_offsets is not None:
            index = np.ascontiguousarray((t.reshape(1, 1, -1) + self._page_offsets).reshape(len(self.flat), -1))
            self._index = self._upload(index).unbind(0)
        else:
            self._index = self._upload(np.ascontiguousarray(t).reshape(-1))

    def _upload(self, host: np.ndarray) -> torch.Tensor:
        return self._to_device(host) if self._to_device is not None else torch.from_numpy(host)

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V of every row, ``[B, H, length, D]``."""
        out = self._out
        if out is None:
            out = self._out = self._step_views()
        index = self._index
        if index is None:  # views in place: every layer's were made at once
            return out[0][layer], out[1][layer]
        stage, rows = self._stage, self._rows
        assert stage is not None
        if self.all_pages is not None:
            torch.index_select(self.all_pages, 0, index[layer], out=stage[: 2 * rows])
        else:
            kp, vp = self.paged[layer]
            torch.index_select(kp, 0, index, out=stage[:rows])
            torch.index_select(vp, 0, index, out=stage[rows : 2 * rows])
        return out

    def _step_views(self) -> tuple[Any, Any]:
        """This step's K and V: per-layer views in place (strided), or the staging buffer's
        K and V halves seen as [B, H, length, D]."""
        b, h, d, n = self.table.shape[0], self.h, self.d, self.length
        if self._strided is None:
            rows = self._rows
            if self._stage is None or self._stage.shape[0] < 2 * rows:
                kp = self.paged[0][0]
                grow = max(2 * rows, 2 * (self._stage.shape[0] if self._stage is not None else 0))
                with persistent():  # written under any grad mode, inference mode included
                    self._stage = torch.empty((grow, self.row), dtype=kp.dtype, device=kp.device)
            st = self._stage
            # [B, pages * page, H, D] read as [B, H, length, D]
            size, stride = (b, h, n, d), (self.npages * self.row, d, h * d, 1)
            return st.as_strided(size, stride, 0), st.as_strided(size, stride, rows * self.row)
        first, apart = self._strided
        size, stride = (b, h, n, d), (apart * self.row, d, h * d, 1)
        if self.layer_step is None:
            return tuple([c.as_strided(size, stride, c.storage_offset() + first * self.row)
                          for c in caches] for caches in zip(*self.flat))
        k = self.flat[0][0]
        layers = len(self.flat)
        size, stride = (2 * layers,) + size, (self.layer_step,) + stride
        views = k.as_strided(size, stride, k.storage_offset() + first * self.row).unbind(0)
        return views[:layers], views[layers:]


def _strided(table: np.ndarray) -> tuple[int, int] | None:
    """(first page, pages from one row's first page to the next) when every row's pages
    are consecutive and the rows are equally far apart, so one strided view covers
    them; None otherwise."""
    b, n = table.shape
    if n == 0:
        return None
    if n > 1 and not bool((table[:, 1:] - table[:, :-1] == 1).all()):
        return None
    if b == 1:
        return int(table[0, 0]), 0
    apart = table[1:, 0] - table[:-1, 0]
    if not bool((apart == apart[0]).all()) or int(apart[0]) < 0:
        return None
    return int(table[0, 0]), int(apart[0])


def _even_spacing(tensors: list[torch.Tensor]) -> int | None:
    """The element offset from each tensor to the next, if they share one storage and are
    evenly spaced in it (0 for a single tensor); None otherwise."""
    if len(tensors) == 1:
        return 0
    base = tensors[0].untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != base for t in tensors):
        return None
    offsets = [t.storage_offset() for t in tensors]
    step = offsets[1] - offsets[0]
    if step <= 0 or any(b - a != step for a, b in zip(offsets, offsets[1:])):
        return None
    return step
