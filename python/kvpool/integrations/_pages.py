"""The batch rows' pages, kept step by step: where each layer stores a step's K/V, and
what attention reads.

``KVPoolCache`` hands attention ``[batch, kv_heads, tokens, head_dim]`` K/V. The rows'
tokens live in whole pages of the pool, so this keeps a host page table of the
batch (``[B, pages]``) and presents K/V in one of two ways:

- **views, no copy**, when every row's pages are consecutive in the pool and the
  rows start equally far apart (one request on a pool whose free pages come in
  order): a strided view of the layer's cache;
- **a page gather** otherwise: one ``index_select`` of whole pages per layer (its K
  and V together) into a staging buffer the cache keeps, seen as ``[B, H, L, D]``
  through a transpose.

Attention (SDPA on CPU, and on CUDA) reads both as well as a contiguous tensor.
While the rows share no page (no prefix hit, no fork) a page never changes under
a row, so the table grows by the new pages of each step; otherwise it is read
again from the allocator (``page_table``) at every step.

A step's new K/V go into the pool through ``[B, H, T, D]`` views of the caches when
its slots are one strided run (every decode step at batch 1; a batch whose rows took
their pages in turn), else through the pool's index store.

Decode steps between page boundaries are predictable: each row's next slot is the one
after its last, and the table does not change. So the step that starts a page also
makes the views of the page's remaining steps, in one loop, and each of those steps
only checks its slots against the prediction and takes its views. The views cost the
same to make either way; made together, the code and data that make them stay in
the CPU's caches, which between two steps the model's weights have evicted.

What attention gets is valid until the next ``update`` of any layer: the staging
buffer is shared by the layers, as one layer's attention runs before the next
layer stores its K/V.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from kvpool.modes import persistent

# (expected slots as a list, store views or None, index tensor or None, attention views or None,
# staging views or None)
_Step = tuple[list[int], Any, Any, Any, Any]


class _PoolViews:
    """What never changes for a pool: its caches' token-major and paged views, and how its
    layers' K and V sit in the one allocation. Made once per pool (``pool_views``)."""

    def __init__(self, pool: Any) -> None:
        self.page = int(pool.page_size)
        self.h, self.d = int(pool.num_kv_heads), int(pool.head_dim)
        self.row = self.page * self.h * self.d  # elements of one page of one layer
        # Each layer's caches, token-major [num_slots, H, D] and by page [num_pages, page * H * D].
        self.flat = [(k.reshape(-1, self.h, self.d), v.reshape(-1, self.h, self.d))
                     for k, v in zip(pool.k_buffers, pool.v_buffers)]
        self.paged = [(k.view(-1, self.row), v.view(-1, self.row)) for k, v in self.flat]
        layers, num_pages = len(self.flat), self.paged[0][0].shape[0]
        # KVPool keeps every layer's K, then every layer's V, back to back in one allocation.
        # Then one strided view covers every layer's K and V (views and store views), and
        # every page of every cache is a row of one [2 * layers * num_pages, page * H * D]
        # view (the gather path: one index_select per layer for K and V together).
        self.layer_step = _even_spacing([k for k, _ in self.flat] + [v for _, v in self.flat])
        self.all_pages: torch.Tensor | None = None
        self.page_offsets: np.ndarray | None = None
        if self.layer_step == num_pages * self.row:
            k0 = self.flat[0][0]
            self.all_pages = k0.as_strided((2 * layers * num_pages, self.row), (self.row, 1), k0.storage_offset())
            # Row of page p of layer l's K (l * num_pages + p) and V ((layers + l) * num_pages + p).
            self.page_offsets = ((np.arange(layers)[:, None] + np.array([0, layers])) * num_pages)[..., None]
        self.to_device = getattr(pool, "_to_device", None)
        self.cpu = torch.device(pool.device).type == "cpu"
        # Staging buffers of closed caches, for the pool's next caches (append and pop are
        # atomic, so caches in several threads never take the same one).
        self.spare_stages: list[torch.Tensor] = []


# Keyed by the pool, which the entries do not reference (their views hold its memory alive,
# not the pool object), so an entry goes with its pool.
_POOL_VIEWS: weakref.WeakKeyDictionary[Any, _PoolViews] = weakref.WeakKeyDictionary()


def pool_views(pool: Any) -> _PoolViews:
    """The pool's ``_PoolViews``, made at its first cache."""
    try:
        return _POOL_VIEWS[pool]
    except (KeyError, TypeError):  # TypeError: a pool that takes no weak reference
        views = _PoolViews(pool)
        try:
            _POOL_VIEWS[pool] = views
        except TypeError:
            pass
        return views


class StepPages:
    """Page table of a batch and the K/V tensors of its current step (non-fp8 pools)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        g = pool_views(pool)
        self.page, self.h, self.d, self.row = g.page, g.h, g.d, g.row
        self.flat, self.paged, self.layer_step, self.all_pages = g.flat, g.paged, g.layer_step, g.all_pages
        self._page_offsets, self._to_device, self.cpu = g.page_offsets, g.to_device, g.cpu
        self._spares = g.spare_stages
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
        self._stage_rows: torch.Tensor | None = None  # the staging rows the gather fills
        # This step: per layer the K and V store views ((k..., ), (v..., )) or None; per layer
        # (k, v) views of the pool for attention, or None and the staging buffer's (k, v).
        self.dst: tuple[Any, Any] | None = None
        self.loc: torch.Tensor | None = None  # this step's slots as a CPU index tensor, when planned
        self._views: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None
        self._plan: list[_Step] = []  # the current page's next decode steps, last step first
        self._spent: list[Any] = []  # the views of this page's past steps

    def reset(self, batch: int, *, private: bool) -> None:
        """Rows opened or reordered: the next step reads the table from the allocator."""
        self.table = np.zeros((batch, 0), dtype=np.int64)
        self.npages, self.length, self.private = 0, -1, private
        self._index = self._strided = self._out = self._views = self._stage_rows = self.dst = self.loc = None
        self._plan, self._spent = [], []

    def advance(self, handles: np.ndarray, before: int, length: int, slots: np.ndarray) -> None:
        """The rows went from ``before`` to ``length`` tokens; ``slots`` are the new ones,
        row-major. Makes this step's store views (``dst``, else ``loc`` on a CPU pool) and
        attention's K/V (``kv``)."""
        plan = self._plan
        if plan:
            step = plan.pop()
            if length == before + 1 and self.length == before and slots.tolist() == step[0]:
                self.length = length
                # The tensors this step replaces are freed with the page's others (see the module doc).
                self._spent.append((self.dst, self.loc, self._views, self._out))
                _, self.dst, self.loc, self._views, self._out = step
                return
            plan.clear()
        self._spent.clear()
        b, p, t = handles.shape[0], self.page, length - before
        npages = -(-length // p)
        if not self.private or self.length != before:
            _, indices, _ = self.pool.allocator.page_table(handles)
            self._set_table(np.asarray(indices, dtype=np.int64).reshape(b, npages))
        elif npages != self.npages:
            # A page starts at each position that is a multiple of the page size.
            new = slots.reshape(b, t)[:, (-before) % p :: p] // p
            if self.table.shape[1] < npages:
                grown = np.zeros((b, max(npages, 2 * self.table.shape[1], 8)), dtype=np.int64)
                grown[:, : self.npages] = self.table[:, : self.npages]
                self.table = grown
            self.table[:, self.npages : npages] = new
            self._set_table(None, npages)
        self.length = length
        run = _slot_run(slots, b, t)
        self.dst = None if run is None else self._store_views(run, b, t)
        self.loc = None
        self._views, self._out = self._attention_views(length)
        if self.private:
            self._plan_page(slots, run, b, t, length)

    def _plan_page(self, slots: np.ndarray, run: tuple[int, int] | None, b: int, t: int, length: int) -> None:
        """The tensors of the decode steps left in the current page, made now (see the module doc)."""
        left = (-length) % self.page  # decode steps before the next page boundary
        if left == 0:
            return
        # Each row's slot for the step to length n is its last one plus n - length.
        last = slots.tolist() if t == 1 else slots.reshape(b, t)[:, -1].tolist()
        if t > 1:
            run = _decode_run(last)
        stores = None if run is None else self._store_views((last[0] + 1, run[1]), b, 1, steps=left)
        plan: list[_Step] = []
        for k in range(left, 0, -1):
            want = [s + k for s in last]
            if stores is None:  # index stores: on a device pool, at the slots each extend uploads
                dst, loc = None, index_tensor(np.array(want, dtype=np.int64)) if self.cpu else None
            else:
                dst, loc = stores[k - 1], None
            views, out = self._attention_views(length + k)
            plan.append((want, dst, loc, views, out))
        self._plan = plan

    def _set_table(self, table: np.ndarray | None, npages: int | None = None) -> None:
        if table is not None:
            self.table, npages = table, table.shape[1]
        assert npages is not None
        self.npages = npages
        t = self.table[:, :npages]
        if table is not None or self._strided is not None:
            self._strided = _strided(t)
        # else: grown by new pages while private, and rows whose earlier pages are not one
        # strided run never become one
        self._index = None
        if self._strided is not None:
            return
        rows = self._rows = t.size
        if self._page_offsets is not None:
            index = (t.reshape(1, 1, -1) + self._page_offsets).reshape(len(self.flat), -1)
            self._index = self._upload(index).unbind(0)
        else:
            self._index = self._upload(np.ascontiguousarray(t).reshape(-1))
        if self._stage is None:
            try:
                self._stage = self._spares.pop()
            except IndexError:
                pass
        if self._stage is None or self._stage.shape[0] < 2 * rows:
            kp = self.paged[0][0]
            grow = max(2 * rows, 2 * (self._stage.shape[0] if self._stage is not None else 0))
            with persistent():  # written under any grad mode, inference mode included
                self._stage = torch.empty((grow, self.row), dtype=kp.dtype, device=kp.device)
        self._stage_rows = self._stage[: 2 * rows]

    def release(self) -> None:
        """The rows are closed: the staging buffer goes to the pool's next cache (what
        attention got from it, like views of the freed pages, is no longer valid)."""
        self.reset(0, private=True)
        stage, self._stage = self._stage, None
        if stage is not None and len(self._spares) < 2:
            self._spares.append(stage)

    def _upload(self, host: np.ndarray) -> torch.Tensor:
        return self._to_device(host) if self._to_device is not None else torch.from_numpy(host)

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V of every row, ``[B, H, length, D]`` (after ``advance``)."""
        views = self._views
        if views is not None:  # in place: made by advance
            return views[layer]
        out = self._out
        assert out is not None
        if self.all_pages is not None:
            torch.index_select(self.all_pages, 0, self._index[layer], out=self._stage_rows)
        else:
            rows, stage = self._rows, self._stage_rows
            assert stage is not None
            kp, vp = self.paged[layer]
            torch.index_select(kp, 0, self._index, out=stage[:rows])
            torch.index_select(vp, 0, self._index, out=stage[rows:])
        return out

    def _store_views(self, run: tuple[int, int], b: int, t: int, steps: int = 0) -> Any:
        """Every layer's K and V destinations of a step whose slots are ``run`` (first slot,
        slots between rows), ``b`` rows of ``t``: ``[b, H, t, D]`` views of the caches, as
        ``((k per layer), (v per layer))``. With ``steps``, a list of those for ``steps``
        decode steps (``t`` 1) whose slots follow one another."""
        first, apart = run
        hd = self.h * self.d
        size: tuple[int, ...] = (b, self.h, t, self.d)
        stride: tuple[int, ...] = (apart * hd, self.d, hd, 1)
        layers, k = len(self.flat), self.flat[0][0]
        if self.layer_step is None:
            per_step = [tuple([c.as_strided(size, stride, c.storage_offset() + (first + i) * hd) for c in caches]
                              for caches in zip(*self.flat)) for i in range(max(steps, 1))]
            return per_step if steps else per_step[0]
        size, stride = (2 * layers,) + size, (self.layer_step,) + stride
        if not steps:
            views = k.as_strided(size, stride, k.storage_offset() + first * hd).unbind(0)
            return views[:layers], views[layers:]
        out = []
        for one in k.as_strided((steps,) + size, (hd,) + stride, k.storage_offset() + first * hd).unbind(0):
            views = one.unbind(0)
            out.append((views[:layers], views[layers:]))
        return out

    def _attention_views(self, n: int) -> tuple[Any, Any]:
        """K and V of length ``n`` for attention: (per-layer (k, v) views in place, None), or
        (None, the staging buffer's K and V halves seen as [B, H, n, D]) for ``kv`` to fill."""
        b, h, d = self.table.shape[0], self.h, self.d
        if self._strided is None:
            st, rows = self._stage, self._rows
            assert st is not None
            # [B, pages * page, H, D] read as [B, H, n, D]
            shape, strides = (b, h, n, d), (self.npages * self.row, d, h * d, 1)
            return None, (st.as_strided(shape, strides, 0), st.as_strided(shape, strides, rows * self.row))
        first, apart = self._strided
        size: tuple[int, ...] = (b, h, n, d)
        stride: tuple[int, ...] = (apart * self.row, d, h * d, 1)
        if self.layer_step is None:
            return [tuple(c.as_strided(size, stride, c.storage_offset() + first * self.row) for c in caches)
                    for caches in self.flat], None
        k = self.flat[0][0]
        layers = len(self.flat)
        size, stride = (2 * layers,) + size, (self.layer_step,) + stride
        views = k.as_strided(size, stride, k.storage_offset() + first * self.row).unbind(0)
        return list(zip(views[:layers], views[layers:])), None


def index_tensor(host: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy(host)``, a normal tensor under any grad mode (made under inference
    mode it would be an inference tensor, which autograd refuses to save)."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return torch.from_numpy(host)
    return torch.from_numpy(host)


def _decode_run(s: list[int]) -> tuple[int, int] | None:
    """``_slot_run`` of one slot per row, given as a list."""
    if len(s) == 1:
        return s[0], 0
    apart = s[1] - s[0]
    if apart < 1 or any(y - x != apart for x, y in zip(s[1:], s[2:])):
        return None
    return s[0], apart


def _slot_run(slots: np.ndarray, b: int, t: int) -> tuple[int, int] | None:
    """(first slot, slots from one row's first to the next) when each row's ``t`` new slots
    (``slots`` row-major) are consecutive and the rows are equally far apart, without
    overlapping, so one strided view of a cache covers them; None otherwise."""
    if t == 1 and b <= 16:  # a decode step: a handful of ints, cheaper as a list than in numpy
        return _decode_run(slots.tolist())
    run = _strided(slots.reshape(b, t))
    if run is None or (b > 1 and run[1] < t):
        return None
    return run


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
    return int(step)
