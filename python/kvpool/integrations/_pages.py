"""The batch rows' pages, kept step by step: where each layer stores a step's K/V, and
what attention reads.

``KVPoolCache`` hands attention ``[batch, kv_heads, tokens, head_dim]`` K/V. The rows'
tokens live in whole pages of the pool, so this keeps a host page table of the
batch (``[B, pages]``) and presents K/V in one of two ways:

- **views, no copy**, when every row's pages are consecutive in the pool and the
  rows start equally far apart (one request on a pool whose free pages come in
  order): a strided view of the layer's cache; not with layer buffers on a pool whose
  caches are one allocation, whose buffers' views are kept across steps and caches
  (``_layer_buffers``), where views of the pages would be made anew at every step;
- **layer buffers** otherwise (the default): each layer keeps its rows' K/V in a buffer
  of its own, ``[B, H, capacity, D]`` for K and for V as ``DynamicCache`` keeps its
  tensors, and each step copies only its new tokens into it. A buffer is gathered from
  the pages (one ``index_select`` of whole pages, K and V together) only when it has
  to grow or no longer holds the rows' first tokens: after ``reset`` (rows opened,
  reordered, cropped or closed) or a step taken through views. Between those, a row's
  earlier tokens never change, so nothing else can make it stale.
- **a page gather** at every step into one staging buffer the layers share, seen as
  ``[B, H, L, D]`` through a transpose, without layer buffers (less memory).

Attention (SDPA on CPU, and on CUDA) reads them all as well as a contiguous tensor.
While the rows share no page (no prefix hit, no fork) a page never changes under
a row, so the table grows by the new pages of each step; otherwise it is read
again from the allocator (``page_table``) at every step.

A step's new K/V go into the pool through ``[B, H, T, D]`` views of the caches when
its slots are one strided run (every decode step at batch 1; a batch whose rows took
their pages in turn), else through the pool's index store, layer by layer. On a pool
that keeps every layer's K and V in one allocation, the steps of private rows whose
layers add their tokens to the layer buffers (``later``) are not stored by their layers:
the owner's ``flush`` stores every such step since the last flush from the buffers at
once (``store_tokens``: one copy of every layer's K and V tokens into a view of the
caches when the slots are one strided run, else one ``index_copy_``), at the next step
that needs a page and before the rows are read or edited. ``KVPoolCache`` starts no step
after one cut short (an exception in a layer) until ``crop`` drops it, and a flush leaves
a step under way to the next flush.

Decode steps between page boundaries are predictable: each row's next slot is the one
after its last, and the table does not change. So the step that starts a page also
makes the views of the page's remaining steps, in one loop, and each of those steps
only checks its slots against the prediction and takes its views. The views cost the
same to make either way; made together, the code and data that make them stay in
the CPU's caches, which between two steps the model's weights have evicted. (Deferred
steps on layer buffers that keep their views: the page's plan itself is kept with them,
``LayerBuffers.plans``, and taken whole by the next page of its kind.)

With layer buffers (on such a pool, CPU or CUDA), those steps are deferred too
(``take_deferred``): the core is not even extended by them until the flush, which catches it
up with one extend. A
deferred step cannot fail: it needs no page (the rows own the page it writes into, and
share none) and stays within the context length. Inside ``generate`` the core call is the
costliest host work of such a step (between two steps the model's weights evict its code
and data): one a page is enough.

What attention gets is valid until the next ``update`` of any layer: the staging
buffer is shared by the layers, as one layer's attention runs before the next
layer stores its K/V (a layer buffer is valid until that layer's next ``update``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool.integrations._buffer_steps import BufferSteps
from kvpool.integrations._layer_buffers import LayerBuffers, allocated_on, reusable, stream_mark, stream_wait
from kvpool.integrations._pool_views import decode_run, index_tensor, pool_views, slot_run, strided_run
from kvpool.integrations._step_views import StepViews
from kvpool.modes import persistent

# (expected slots as a list, store views or None, index tensor or None, attention views or None,
# staging views or None, layer-buffer views of the step's token or None, and for a deferred step
# its ``_decode`` when the layer buffers keep their views, else None)
_Step = tuple[list[int], Any, Any, Any, Any, Any, Any]


class StepPages(BufferSteps, StepViews):
    """Page table of a batch and the K/V tensors of its current step (non-fp8 pools)."""

    def __init__(self, pool: Any, *, layer_buffers: bool = True) -> None:
        self.pool = pool
        self.layer_buffers = layer_buffers
        g = pool_views(pool)
        self.page, self.h, self.d, self.row = g.page, g.h, g.d, g.row
        self.flat, self.paged, self.layer_step, self.all_pages = g.flat, g.paged, g.layer_step, g.all_pages
        self._page_offsets, self._to_device, self.cpu = g.page_offsets, g.to_device, g.cpu
        self._all_slots = g.all_slots
        self._all_rows, self._cache_rows = g.all_rows, g.cache_rows
        self._layers = len(self.flat)
        self._spares = g.spare_stages
        ctx = getattr(pool, "max_context_len", None)
        self._max_tokens = -(-int(ctx) // self.page) * self.page if ctx else 1 << 62
        self.table = np.zeros((0, 0), dtype=np.int64)
        self.npages = 0
        self.length = 0
        self.private = True
        # Gather path: per layer, the rows of its K pages then V pages in all_pages; or
        # (without all_pages) one [B * pages] index of page ids used for every cache.
        self._index: Any = None
        self._rows = 0  # pages gathered per cache
        self._strided: tuple[int, int] | None = None  # (first page, pages between rows) for views
        self._stage: torch.Tensor | None = None  # flat storage of the staging or layer buffers
        self._stage_streams: set[Any] = set()  # the streams it is marked as used on (``stream_mark``)
        self._stage_rows: torch.Tensor | None = None  # the staging rows the gather fills
        # Layer buffers: [2 (K, V), layers, B, H, cap, D] over the staging storage, the
        # tokens each row has room for, and how many of them hold every layer's K/V (-1:
        # none, gather them from the pages at the next step).
        self._lb: LayerBuffers | None = None
        self._buffer_spares = g.spare_buffers
        self._filled = -1
        # This step, in the layer buffers: per layer (k, v) views of the step's tokens to copy
        # the new K/V into, or None; and whether each layer gathers its pages into its buffer.
        self._app: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._fill = False
        self._plain = False  # attention's K/V are this step's views as they are (kv needs no work)
        # A deferred step (``take_deferred``): per layer (k dest, v dest, attention's (k, v)), which
        # ``KVPoolCache.update`` uses directly; None for every other step.
        self._decode: list[tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] | None = None
        # A step of private rows whose layers add their tokens to the layer buffers, on a pool
        # whose caches are one allocation, is not stored by its layers: the owner's flush
        # stores the steps since the last one from the buffers at once (``store_tokens``).
        self.later = False
        # This step: per layer the K and V store views ((k..., ), (v..., )) or None; per layer
        # (k, v) views of the pool for attention, or None and the staging buffer's (k, v).
        self.dst: tuple[Any, Any] | None = None
        self.loc: torch.Tensor | None = None  # this step's slots as a CPU index tensor, when planned
        self._views: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None
        self._plan: list[_Step] = []  # the current page's next decode steps, last step first
        self._spent: list[Any] = []  # the views of this page's past steps
        # Whether ``_plan`` holds deferred steps (``take_deferred``): their tokens go to the
        # layer buffers alone, and reach the core and the pool's caches at ``store_tokens``.
        self.deferring = False
        self._ctx = int(ctx) if ctx else 1 << 62  # no deferred step may pass the context length
        # CUDA: the raw handle of the stream the last step ran on (its layers wrote the buffers
        # there), which ``store_tokens`` follows when it runs on another (set by the owner).
        self.steps_on: int | None = None

    def reset(self, batch: int, *, private: bool) -> None:
        """Rows opened or reordered: the next step reads the table from the allocator."""
        self.table = np.zeros((batch, 0), dtype=np.int64)
        self.npages, self.length, self.private = 0, -1, private
        self._index = self._strided = self._out = self._views = self._stage_rows = self.dst = self.loc = None
        self._plan, self._spent, self.deferring = [], [], False
        self.later = False
        self._app, self._fill, self._filled, self._plain, self._decode = None, False, -1, False, None
        if self._lb is not None and self._lb.b != batch:
            self._set_buffers(None)

    def advance(self, handles: np.ndarray, before: int, length: int, slots: np.ndarray) -> None:
        """The rows went from ``before`` to ``length`` tokens; ``slots`` are the new ones,
        row-major. Makes this step's store views (``dst``, else ``loc`` on a CPU pool) and
        attention's K/V (``kv``)."""
        plan = self._plan
        self._decode = None
        if plan:
            step = plan.pop()
            if length == before + 1 and self.length == before and slots.tolist() == step[0]:
                self.length = length
                # The tensors this step replaces are freed with the page's others (see the module doc).
                self._spent.append((self.dst, self.loc, self._views, self._out, self._app))
                _, self.dst, self.loc, self._views, self._out, self._app, _ = step
                self._fill = False
                if self._app is not None:
                    self._filled = length
                self._plain = self._app is None and self._views is not None
                return
            plan.clear()
        self._spent.clear()
        self.deferring = False
        b, p, t = handles.shape[0], self.page, length - before
        npages = -(-length // p)
        if not self.private or self.length != before:
            _, indices, _ = self.pool.allocator.page_table(handles)
            self._set_table(np.asarray(indices, dtype=np.int64).reshape(b, npages))
        elif npages != self.npages:
            # A page starts at each position that is a multiple of the page size (a decode
            # step that takes a page: its one slot per row is the page's first).
            if self.table.shape[1] < npages:
                grown = np.zeros((b, max(npages, 2 * self.table.shape[1], 8)), dtype=np.int64)
                grown[:, : self.npages] = self.table[:, : self.npages]
                self.table = grown
            if t == 1:
                # Item by item: a numpy ufunc's first call after the model's forward costs
                # more host time than a few int stores.
                col, table = self.npages, self.table
                for i, s in enumerate(slots.tolist()):
                    table[i, col] = s // p
            else:
                self.table[:, self.npages : npages] = slots.reshape(b, t)[:, (-before) % p :: p] // p
            self._set_table(None, npages)
        self.length = length
        self.loc, self.later = None, False
        self._app, self._fill = None, False
        run = slot_run(slots, b, t)
        if self._strided is None and self.layer_buffers:
            self._buffer_step(before, length, slots, run)
        else:
            self._filled = -1  # the buffers miss this step's tokens
        self.dst = None if run is None or self.later else self._store_views(run, b, t)
        self._views, self._out = self._attention_views(length)
        self._plain = self._app is None and not self._fill and self._views is not None
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
            run = decode_run(last)
        buffered = self._strided is None and self.layer_buffers
        if buffered and self._all_slots is not None:  # deferred: stored from the buffers later
            self._plan = self._plan_deferred(length, min(left, self._ctx - length))
            self.deferring = bool(self._plan)
            return
        apps = self._lb.tokens(length, left) if buffered and self._lb is not None else None
        stores = None if run is None else self._store_views((last[0] + 1, run[1]), b, 1, steps=left)
        plan: list[_Step] = []
        for k in range(left, 0, -1):
            want = [s + k for s in last]
            if stores is None:  # index stores: on a device pool, at the slots each extend uploads
                dst, loc = None, index_tensor(np.array(want, dtype=np.int64)) if self.cpu else None
            else:
                dst, loc = stores[k - 1], None
            views, out = self._attention_views(length + k)
            plan.append((want, dst, loc, views, out, None if apps is None else apps[k - 1], None))
        self._plan = plan

    def _plan_deferred(self, length: int, left: int) -> list[_Step]:
        """``_plan_page``'s steps when the layers add their tokens to the layer buffers: each
        step's views of the buffers (where each layer adds its token, and what attention
        reads), and nothing of the pool (see ``take_deferred``)."""
        if left <= 0:
            return []
        lb = self._lb
        assert lb is not None
        if lb.keep:
            # Buffers that keep their views keep the plans made of them too (``LayerBuffers.plans``):
            # a page's plan is then one lookup and a list copy, from the second page of its kind on
            # (the next generate's, on the buffers a closed cache left to the pool).
            kept = lb.plans.get((length, left))
            if kept is None:
                apps = lb.tokens(length, left)
                kept = lb.plans[length, left] = tuple(
                    ([], None, None, lb.attention(length + k), None, apps[k - 1], lb.decode(length + k))
                    for k in range(left, 0, -1))
            return list(kept)
        apps = lb.tokens(length, left)
        plan: list[_Step] = []
        for k in range(left, 0, -1):
            plan.append(([], None, None, lb.attention(length + k), None, apps[k - 1], None))
        return plan

    def take_deferred(self, length: int) -> None:
        """A decode step to ``length`` tokens from a deferred plan (``deferring``): no extend,
        no store. Its token stays in the layer buffers until ``store_tokens``, which the
        rows' owner calls before anything reads the pool: the step needs no new page (it
        ends before the page the rows last extended into does, and before the context
        length), so the core has nothing to refuse, and until then only this batch owns
        the page's slots (the rows share no page)."""
        step = self._plan.pop()
        self.length = self._filled = length
        # The tensors this step replaces are freed with the page's others (see the module doc).
        self._spent.append((self.dst, self.loc, self._views, self._out, self._app))
        _, self.dst, self.loc, self._views, self._out, self._app, decode = step
        self._fill = self._plain = False
        self.later = True
        if decode is None:  # (buffers too large to keep their views: this step's own, which its page's plan made)
            assert self._app is not None and self._views is not None
            decode = [(dk, dv, kv) for (dk, dv), kv in zip(self._app, self._views)]
        self._decode = decode
        self.deferring = bool(self._plan)

    def _set_table(self, table: np.ndarray | None, npages: int | None = None) -> None:
        if table is not None:
            self.table, npages = table, table.shape[1]
        assert npages is not None
        self.npages = npages
        if self.layer_buffers and self._all_slots is not None:
            # With layer buffers, a pool whose caches are one allocation reads them even when the
            # rows' pages are one strided run: their views are kept across steps and caches
            # (``_layer_buffers``), and steps are deferred (``take_deferred``; on CUDA that spares
            # each step the extend's upload and table launch); views of the pages are made anew
            # every time.
            self._strided = None
        elif table is not None or self._strided is not None:
            self._strided = strided_run(self.table[:, :npages])
        # else: grown by new pages while private, and rows whose earlier pages are not one
        # strided run never become one
        self._index = None
        if self._strided is not None:
            return
        self._rows = self.table.shape[0] * npages
        if not self.layer_buffers:
            self._make_index()
            self._stage_rows = self._storage(2 * self._rows * self.row).view(2 * self._rows, self.row)
        # else: the layer buffers gather only when they grow or after a reset (_gather_layer)

    def _make_index(self) -> None:
        """The gather's index of the rows' pages (``_index``)."""
        t = self.table[:, : self.npages]
        if self._page_offsets is not None:
            index = (t.reshape(1, 1, -1) + self._page_offsets).reshape(len(self.flat), -1)
            self._index = self._upload(index).unbind(0)
        else:
            self._index = self._upload(np.ascontiguousarray(t).reshape(-1))

    def _storage(self, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of the staging storage, grown (or taken from a closed
        cache of the pool) to hold them."""
        if self._stage is None and not self.layer_buffers and reusable(self.paged[0][0]):
            try:
                stage, fence, streams = self._spares.pop()
            except IndexError:
                pass
            else:
                stream_wait(stage, fence, streams)  # (a closed cache's, maybe on another stream)
                self._stage, self._stage_streams = stage, streams
        if self._stage is None or self._stage.numel() < numel:
            kp = self.paged[0][0]
            grow = max(numel, 2 * (self._stage.numel() if self._stage is not None else 0))
            with persistent():  # written under any grad mode, inference mode included
                self._stage = torch.empty(grow, dtype=kp.dtype, device=kp.device)
            self._stage_streams = allocated_on(self._stage)
        return self._stage[:numel]

    def release(self) -> None:
        """The rows are closed: the shared staging buffer and the layer buffers go to the
        pool's next caches (the layer buffers within the bounds ``_layer_buffers`` gives;
        what attention got from either, like views of the freed pages, is no longer valid)."""
        self.reset(0, private=True)
        self._set_buffers(None)
        stage, self._stage = self._stage, None
        # (not while capturing: no fence could be recorded for the next cache to wait on)
        if stage is not None and not self.layer_buffers and len(self._spares) < 2 and reusable(stage):
            self._spares.append((stage, stream_mark(stage, self._stage_streams), self._stage_streams))

    def _upload(self, host: np.ndarray) -> torch.Tensor:
        return index_tensor(host, self._to_device)

    def kv(self, layer: int, k: torch.Tensor | None = None,
           v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V of every row, ``[B, H, length, D]`` (after ``advance``
        and after the layer stored this step's ``k``/``v`` in the pool; with layer buffers
        they are also added to the layer's buffer, or without them the buffer is gathered)."""
        views = self._views
        if views is not None:  # views of the pool or of the layer buffers, made by advance
            app = self._app
            if app is not None and k is not None:
                dk, dv = app[layer]
                dk.copy_(k)
                dv.copy_(v)  # type: ignore[arg-type]
            elif self._fill or (app is not None and not self.later):
                # (later: the step is added to the buffers, never gathered from the pool, which
                # gets it from them at the next flush)
                self._gather_layer(layer)
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
