"""``PoolSlots``: which slot tensors a pool made itself, so ``write`` / ``read`` skip their
value checks. Split from ``rows`` (which re-exports it)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["PoolSlots"]

# (slots tensor, numpy array sharing its memory or None, the tensor's version when
# made, no padding / page-0 / repeated slot among them, any negative among them)
_Record = tuple[torch.Tensor, Any, int, bool, bool]
_NO_ARRAY = object()  # a record without an array: never the ``slots`` a caller passes


class PoolSlots:
    """The last few slot arrays a pool made, recognised by identity while unchanged.

    Their values are in range by construction (a pool's own extend results are
    also distinct, never in page 0 and never negative), so ``write`` / ``read``
    skip the value checks for them; any other tensor, list or array is checked in
    full. "Unchanged" is torch's version counter: an in-place torch op on the
    tensor, or on any view of it, makes it an ordinary caller tensor again (the
    pool makes these tensors outside inference mode, so they have one). Only CPU
    pools whose rows move through torch keep a record: on CUDA device slots are
    never value-checked (a check would sync), and the Triton kernels would not
    bounds-check a slot changed behind torch's back (through ``ExtendResult.slots``,
    ``.numpy()`` or ``torch.from_numpy`` of either, which share its memory, or
    ``.data``, which has a version counter of its own). On a CPU pool such a change
    is still refused with nothing written: ``write`` stores a recorded tensor with
    the core's row copy, which checks every slot before it copies a row, and checks
    it in full first where it stores with torch instead (fp8, a source the row copy
    declines), where torch would refuse a bad slot only after storing the rows
    before it; ``read`` lets torch's indexing refuse it and then checks it as a
    caller's. Either way a slot out of range is a ``SlotRangeError`` and a negative
    one padding. What such a change escapes is ``strict=True``: a repeated slot, a
    page-0 slot or padding written into a recorded tensor behind torch's back is
    stored (or skipped) as ``strict=False`` would, since the record says the tensor
    holds none.

    The last ``SIZE`` records are kept (a step's slots stay alive until a few more
    extends have run). Lookups and updates are single reads and writes of one
    tuple, safe from several threads (a lost update only means one more full check).
    """

    SIZE = 4

    def __init__(self) -> None:
        self._ring: tuple[_Record, ...] = ()

    def add(self, tensor: torch.Tensor, array: np.ndarray | None = None, *, clean: bool,
            negative: bool) -> None:
        if tensor.is_inference():  # no version counter to tell a later in-place change
            return
        rec = (tensor, _NO_ARRAY if array is None else array, tensor._version, clean, negative)
        self._ring = (rec,) + self._ring[: self.SIZE - 1]

    def get(self, obj: Any) -> _Record | None:
        """The record of ``obj`` if the pool made it and torch saw no change since, else None."""
        for rec in self._ring:
            if rec[0] is obj or rec[1] is obj:
                return rec if rec[0]._version == rec[2] else None
        return None
