"""HybridRows: ``write`` and ``read`` of a hybrid ``KVPool``'s K/V rows, each in the caches of
the layer's group, and ``_store_bhtd``, ``KVPoolCache``'s store of checked K/V. A mixin of
``HybridKVPool`` (kept apart so hybrid.py holds construction and geometry), as ``RowsMixin``
(``kvpool.rows``) is of the plain pool.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpool._eager import eager_only
from kvpool.errors import TensorShapeError
from kvpool.layout import KVStorage
from kvpool.row_stores import index_copy_rows, scatter_into
from kvpool.staging import to_device
from kvpool.validate import check_flag, check_rows, slots_tensor

__all__ = ["HybridRows"]


class HybridRows:
    """The per-layer writes and reads of ``HybridKVPool``."""

    # HybridKVPool's state these read (made by its __init__).
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    group_of_layer: tuple[int, ...]
    _storage: list[KVStorage | None]
    _slot_in_group: dict[int, int]
    _page_group: Any  # (HybridKVPool's: the group of a layer with pages)
    _to_device: Any  # the pinned ring's copy (CUDA); None on CPU

    def _device_slots(self, idx: torch.Tensor, negative: bool) -> tuple[torch.Tensor, bool]:
        """Checked slots as a CUDA pool indexes with them: host slots staged through the
        pool's ring (as the plain pool's ``write``: index_copy_ / index_select refuse an index
        on another device), and padding sent to the group's reserved page 0, its sink, rather
        than dropped with ``nonzero``, which waits for the device at every layer's write (device
        slots are always reported as maybe negative) and cannot be captured. A CPU pool's slots
        are returned as they are."""
        if self._to_device is None:
            return idx, negative
        idx = self._staged(idx)
        return (idx.clamp(min=0), False) if negative else (idx, False)

    def _staged(self, idx: torch.Tensor) -> torch.Tensor:
        """Host slots on a CUDA pool, copied to the device through the pool's ring (the plain
        pool's ``_slots`` does the same); anything else as it is."""
        if self._to_device is not None and idx.device.type == "cpu":
            return to_device(idx.numpy(), self.device, self._to_device)
        return idx

    def write(self, layer: int, slots: Any, k: torch.Tensor, v: torch.Tensor | None = None, *,
              strict: bool = False) -> None:
        """Store rows ``k[i]`` / ``v[i]`` at ``slots[i]`` of ``layer`` (slots of its group).
        Negative slots are padding and skipped; everything is checked first. ``strict=True``
        rejects padding, the group's page-0 slots and repeated slots, as on a plain pool.

        Raises:
            LayerIndexError, InvalidArgumentError (a state layer), SlotRangeError,
            ReservedSlotError, DuplicateSlotError, TensorShapeError, TensorDtypeError,
            TensorDeviceError: nothing written.
        """
        if torch.compiler.is_compiling() and self.device.type == "cpu":
            # As the plain pool's write: one eager call (its slot check reads slot values), not
            # the rest of the call compiled once per layer and batch size (and, as there, the
            # arguments in one tuple, which torch 2.4 does not guard at the break).
            return _write_eager(self, *(layer, slots, k, v), strict=strict)
        g = self._page_group(layer)
        if v is None:  # (the plain pool's signature: v is optional there for MLA, which has no groups)
            raise TensorShapeError("write(layer, slots, k, v) needs both k and v")
        if strict is not False and strict is not True:
            strict = check_flag("strict", strict)
        idx, negative = slots_tensor(slots, self.device, g.num_pages * g.page_size, g.page_size, strict=strict)
        for name, x in (("k", k), ("v", v)):
            check_rows(name, x, idx.shape[0], self.num_kv_heads, self.head_dim, self.dtype, self.device)
        idx, negative = self._device_slots(idx, negative)
        k, v = k.detach(), v.detach()
        if negative:
            keep = (idx >= 0).nonzero().squeeze(1)
            idx, k, v = idx.index_select(0, keep), k.index_select(0, keep), v.index_select(0, keep)
        st = self._storage[g.index]
        assert st is not None
        i = self._slot_in_group[layer]
        caches = (st.flat[0][i], st.flat[1][i])
        if self.device.type != "cpu" or not scatter_into(caches, idx, (k, v)):
            index_copy_rows(caches, idx.long(), k, v)

    def _store_bhtd(self, layer: int, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``write`` of checked K/V in attention's ``[B, H, T, D]`` layout at pool-made slots."""
        st = self._storage[self.group_of_layer[layer]]
        assert st is not None
        b, h, t, d = k.shape
        i = self._slot_in_group[layer]
        caches = (st.flat[0][i], st.flat[1][i])
        # Row-major like the slots (a view for a decode step's one token).
        k = k.detach().transpose(1, 2).reshape(b * t, h, d)
        v = v.detach().transpose(1, 2).reshape(b * t, h, d)
        # As write's store: the core's row copy on the CPU, where index_copy_ walks each row
        # element by element.
        if self.device.type != "cpu" or not scatter_into(caches, idx, (k, v)):
            caches[0].index_copy_(0, idx, k)
            caches[1].index_copy_(0, idx, v)

    def read(self, layer: int, slots: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather ``layer``'s rows at ``slots`` (new tensors); negative slots read zeros."""
        if torch.compiler.is_compiling() and self.device.type == "cpu":
            return _read_eager(self, *(layer, slots))  # as in write (the tuple too)
        g = self._page_group(layer)
        idx, negative = slots_tensor(slots, self.device, g.num_pages * g.page_size, g.page_size, strict=False)
        idx = self._staged(idx)  # (padding stays negative: it is masked below, without a sync)
        st = self._storage[g.index]
        assert st is not None
        i = self._slot_in_group[layer]
        idx = idx.long()
        safe = idx.clamp(min=0) if negative else idx
        k, v = st.flat[0][i].index_select(0, safe), st.flat[1][i].index_select(0, safe)
        if negative:
            pad = (idx < 0).view(-1, 1, 1)
            k, v = k.masked_fill(pad, 0), v.masked_fill(pad, 0)
        return k, v


# write / read of a host pool while torch.compile traces: run eagerly (see write).
_write_eager: Any = eager_only(globals(), "_write_eager", HybridRows.write)
_read_eager: Any = eager_only(globals(), "_read_eager", HybridRows.read)
