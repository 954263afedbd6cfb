"""The device tables: host -> device mirrors of allocator state (``req_to_token``
rows, FlashInfer page tables), and the result types that carry them.

The allocator (host) is the single source of truth; device tables are
write-only mirrors. Each update ships one host array with one non-blocking H2D
copy (``kvpool.staging.to_device``: the pool's pinned ring on CUDA, since a
copy from pageable memory may make the driver synchronise with the stream to
stage it). Nothing is ever read back. The table write itself is the launch of
``kvpool.kernels.write_req_to_token`` (``write_packed_table``: the core's own values, not
checked again).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvpool.kernels.table_ops import write_packed_kept, write_packed_table
from kvpool.packed import PackedExtend, segment_len, slots_start
from kvpool.staging import ToDevice, to_device

__all__ = ["ExtendResult", "PageTable", "page_table_tensors", "update_req_to_token"]


class ExtendResult(NamedTuple):
    """New slots of an ``extend``, flattened in request order.

    ``slots`` is the host int64 array; ``out_cache_loc`` the same values as an
    int64 tensor on the pool's device (zero copy on CPU), ready to be a step's
    ``out_cache_loc`` / ``slot_mapping``. It is a per-step value, not pool state:
    a normal tensor (never an inference tensor, even made under inference mode),
    so an engine may edit it in place in any grad mode.
    """

    slots: np.ndarray
    out_cache_loc: torch.Tensor


class PageTable(NamedTuple):
    """FlashInfer CSR page table of a batch, int32 tensors on the pool's device."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


def update_req_to_token(
    req_to_token: torch.Tensor, packed: np.ndarray, num_requests: int, ring: ToDevice | None = None
) -> tuple[np.ndarray, torch.Tensor]:
    """Apply one ``SlotAllocator.extend_packed`` result to a device ``req_to_token``.

    ``packed`` is laid out as ``kvpool.packed.PackedExtend`` names it (every
    part 16-byte aligned). One H2D copy (through ``ring`` when given), then one
    table write with the host-computed offsets, sparing the kernel its
    on-device prefix sum.

    Returns:
        The new slots as a host int64 array (a view of ``packed``) and as a
        device int64 tensor (a view of the copied buffer) for ``out_cache_loc``.
    """
    staged = to_device(packed, req_to_token.device, ring)
    start = slots_start(num_requests)
    if write_packed_kept(req_to_token, staged, num_requests, segment_len(num_requests)):
        return packed[start:], staged[start:]  # (one view: the step's out_cache_loc)
    dev = PackedExtend.parse(staged, num_requests)
    write_packed_table(req_to_token, dev.rows, dev.starts, dev.counts, dev.slots, dev.offsets)
    return packed[start:], dev.slots


def page_table_tensors(
    indptr: np.ndarray, indices: np.ndarray, last: np.ndarray, device: torch.device,
    ring: ToDevice | None = None,
) -> PageTable:
    """The allocator's CSR arrays as device tensors (zero copy on CPU, one H2D copy elsewhere)."""
    if device.type == "cpu":
        return PageTable(torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last))
    a, b = indptr.shape[0], indices.shape[0]
    dev = to_device(np.concatenate([indptr, indices, last]).astype(np.int32, copy=False), device, ring)
    return PageTable(dev[:a], dev[a : a + b], dev[a + b :])
