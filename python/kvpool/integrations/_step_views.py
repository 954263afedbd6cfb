"""The views ``StepPages`` hands out and stores through: every one is a strided view of the
pool's caches (or of the layer buffers, which ``LayerBuffers`` makes and keeps), made with
one ``as_strided`` for every layer's K and V (and, for the decode steps of a page made
ahead, for every step) and split with ``unbind``: a tensor made costs the same either way,
the Python calls that make them do not.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool.integrations._layer_buffers import LayerBuffers


class StepViews:
    """Mixed into ``StepPages``, whose state these read."""

    h: int
    d: int
    row: int
    npages: int
    layer_buffers: bool
    table: np.ndarray
    flat: list[tuple[torch.Tensor, torch.Tensor]]
    layer_step: int | None
    _lb: LayerBuffers | None
    _stage: torch.Tensor | None
    _rows: int
    _strided: tuple[int, int] | None

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
        if self._strided is None and self.layer_buffers:
            lb = self._lb
            assert lb is not None
            return lb.attention(n), None
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
