"""Host -> device mirrors of allocator state (req_to_token rows, page tables).

The allocator (host) is the single source of truth; device tables are
write-only mirrors. Each update ships one host array with one non-blocking H2D
copy through ``to_device``: for a CUDA pool that is the pool's pinned ring
(``kvpool.staging.PinnedRing``), since a copy from pageable memory may make the
driver synchronise with the stream to stage it. Nothing is ever read back.
The table write itself is ``kvpool.kernels.write_req_to_token``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch

from kvpool.kernels import write_req_to_token

__all__ = ["ExtendResult", "PageTable", "page_table_tensors", "update_req_to_token"]


class ExtendResult(NamedTuple):
    """New slots of an ``extend``, flattened in request order.

    ``slots`` is the host int64 array; ``out_cache_loc`` the same values as an
    int64 tensor on the pool's device (zero copy on CPU), ready to be a step's
    ``out_cache_loc`` / ``slot_mapping``. It is a per-step value made in the
    caller's grad mode, not pool state.
    """

    slots: np.ndarray
    out_cache_loc: torch.Tensor


class PageTable(NamedTuple):
    """FlashInfer CSR page table of a batch, int32 tensors on the pool's device."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


ToDevice = Callable[[np.ndarray], torch.Tensor]


def _to_device(host: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(host).to(device, non_blocking=True)


def update_req_to_token(
    req_to_token: torch.Tensor, packed: np.ndarray, num_requests: int, to_device: ToDevice | None = None
) -> tuple[np.ndarray, torch.Tensor]:
    """Apply one ``SlotAllocator.extend_packed`` result to a device ``req_to_token``.

    ``packed`` is ``[rows | starts | counts | offsets | slots]``, the first four
    segments ``num_requests`` rounded up to even long (so every segment stays
    16-byte aligned: Triton specializes pointer arguments on that, and odd
    offsets would compile new kernel variants mid-serving whenever a batch size
    changes parity). One H2D copy (``to_device``, default a plain non-blocking
    copy), then one table write (with the host-computed offsets, sparing the
    kernel its on-device prefix sum).

    Returns:
        The new slots as a host int64 array (a view of ``packed``) and as a
        device int64 tensor (a view of the copied buffer) for ``out_cache_loc``.
    """
    b = num_requests
    head = 4 * (b + (b & 1))
    dev = to_device(packed) if to_device is not None else _to_device(packed, req_to_token.device)
    rows, starts, counts, offsets = dev[:head].view(4, -1)[:, :b]
    slots = dev[head:]
    write_req_to_token(req_to_token, rows, starts, counts, slots, offsets=offsets)
    return packed[head:], slots


def page_table_tensors(
    indptr: np.ndarray, indices: np.ndarray, last: np.ndarray, device: torch.device,
    to_device: ToDevice | None = None,
) -> PageTable:
    """The allocator's CSR arrays as device tensors (zero copy on CPU, one H2D copy on CUDA)."""
    if device.type == "cpu":
        return PageTable(torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last))
    a, b = indptr.shape[0], indices.shape[0]
    host = np.concatenate([indptr, indices, last]).astype(np.int32, copy=False)
    dev = to_device(host) if to_device is not None else _to_device(host, device)
    return PageTable(dev[:a], dev[a : a + b], dev[a + b :])
