"""``StepPages``' layer buffers (``_layer_buffers``): a step's tokens added to them or the
rows' pages gathered into them, and the flush's store of deferred steps from them into the
pool (``store_tokens``). A mixin over ``StepPages``' state (``_pages`` has the whole story)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvpool.integrations._layer_buffers import LayerBuffers, follow_stream
from kvpool.integrations._pool_views import slot_run
from kvpool.row_stores import scatter_into

__all__ = ["BufferSteps"]


class BufferSteps:
    """The layer-buffer half of ``StepPages``."""

    # StepPages' state this half reads (made by StepPages and StepViews).
    _lb: LayerBuffers | None
    _buffer_spares: Any
    h: int
    d: int
    page: int
    npages: int
    length: int
    private: bool
    later: bool
    table: np.ndarray
    flat: Any
    paged: Any
    all_pages: torch.Tensor | None
    steps_on: int | None
    _index: Any
    _filled: int
    _fill: bool
    _app: Any
    _all_slots: torch.Tensor | None
    _all_rows: torch.Tensor | None
    _cache_rows: Any
    _max_tokens: int
    _upload: Callable[[np.ndarray], torch.Tensor]
    _make_index: Callable[[], None]

    def _buffer_step(self, before: int, length: int, slots: np.ndarray, run: tuple[int, int] | None) -> None:
        """A gathered step with layer buffers: each layer adds the step's tokens to its buffer
        (``_app``) when the buffer holds the rows' first ``before`` tokens, else gathers its
        pages into it (``_fill``), made big enough for the rows' current pages. A decode step
        that adds, of private rows on a pool whose caches are one allocation, is stored from
        the buffers at the owner's flush (``later``)."""
        need = self.npages * self.page
        if self._lb is None or self._lb.cap < need:
            self._filled = -1
            b, layers = self.table.shape[0], len(self.flat)
            # Doubling keeps the gathers at growth few, and the first buffers get the same room
            # (a prompt's buffers would otherwise grow, and be gathered again, at the first
            # decode step that takes a page); no row ever holds more than the context length.
            cap = max(need, min(2 * (self._cap or need), self._max_tokens))
            lb = self._buffer_spares.take(b, need, self.paged[0][0])  # a closed cache's, with room enough
            self._set_buffers(lb if lb is not None else LayerBuffers(self.paged[0][0], layers, b, self.h, cap, self.d))
        if self._filled == before or before == 0:  # (a prompt step: the buffers get its tokens whole)
            lb = self._lb
            assert lb is not None
            self._app = lb.tokens(before, 1)[0] if length == before + 1 else lb.prompt(before, length - before)
            self.later = self.private and self._all_slots is not None
        else:
            self._fill = True
        self._filled = length

    def _set_buffers(self, lb: LayerBuffers | None) -> None:
        """Take ``lb`` as the layer buffers; the ones it replaces go to the pool's spares."""
        old = self._lb
        if old is not None and old is not lb:
            self._buffer_spares.give(old)
        self._lb = lb

    @property
    def _buf(self) -> torch.Tensor | None:
        """The layer buffers as ``[2 (K, V), layers, B, H, cap, D]``, or None."""
        return None if self._lb is None else self._lb.buf

    @property
    def _cap(self) -> int:
        """Tokens per row the layer buffers have room for (0: none)."""
        return 0 if self._lb is None else self._lb.cap

    def add(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add the step's K/V ``[B, H, T, D]`` of ``layer`` to its buffer (a ``later`` step driven
        by ``BatchRequests.write`` rather than ``kv``)."""
        app = self._app
        assert app is not None
        dk, dv = app[layer]
        dk.copy_(k)
        dv.copy_(v)

    def store_tokens(self, first: int, slots: np.ndarray) -> None:
        """Store every layer's tokens ``first`` on, from the layer buffers, at ``slots`` (row-major:
        each row's in turn, as many per row as the flush stores)."""
        b = self.table.shape[0]
        n = slots.shape[0] // b
        run = slot_run(slots, b, n)
        if run is not None:
            self.store_run(first, n, run)
            return
        lb, all_slots = self._lb, self._all_slots
        assert lb is not None and all_slots is not None
        if self.steps_on is not None:
            follow_stream(all_slots.device, self.steps_on)
        both = lb.both
        src = both[:, :, :, first : first + n]  # [2 * layers, B, H, n, D]
        rows = src.transpose(2, 3).reshape(both.shape[0] * b * n, self.h, self.d)  # (a copy)
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        if self._all_rows is not None and scatter_into(
                (self._all_rows,), torch.from_numpy((self._cache_rows + slots).reshape(-1)), (rows,)):
            return
        all_slots.index_copy_(1, self._upload(slots), rows.view(both.shape[0], b * n, self.h, 1, self.d))

    def store_run(self, first: int, n: int, run: tuple[int, int]) -> None:
        """``store_tokens`` of ``n`` tokens a row whose slots are one strided run (``slot_run``):
        one copy of every layer's K and V, from the layer buffers into a view of the caches."""
        lb, all_slots = self._lb, self._all_slots
        assert lb is not None and all_slots is not None
        if self.steps_on is not None:
            follow_stream(all_slots.device, self.steps_on)
        both, b, hd = lb.both, lb.b, self.h * self.d
        size, stride = (both.shape[0], b, self.h, n, self.d), (all_slots.stride(0), run[1] * hd, self.d, hd, 1)
        all_slots.as_strided(size, stride, all_slots.storage_offset() + run[0] * hd).copy_(lb.span(first, n))

    def _gather_layer(self, layer: int) -> None:
        """Gather the rows' pages of ``layer`` into its buffer (the first ``length`` tokens)."""
        buf = self._buf
        assert buf is not None
        if self._index is None:
            self._make_index()
        b, n, hd = buf.shape[2], self.length, (self.h, self.d)
        if self.all_pages is not None:
            got = torch.index_select(self.all_pages, 0, self._index[layer]).view(2, b, -1, *hd)
            buf[:, layer, :, :, :n].copy_(got[:, :, :n].transpose(2, 3))
        else:
            for cache, pages in zip(buf, self.paged[layer]):
                got = torch.index_select(pages, 0, self._index).view(b, -1, *hd)
                cache[layer, :, :, :n].copy_(got[:, :n].transpose(1, 2))
