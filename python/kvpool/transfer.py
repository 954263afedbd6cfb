"""Host -> device mirrors of allocator state (req_to_token rows, page tables).

The allocator (host) is the single source of truth; device tables are
write-only mirrors. Each update packs everything it needs into one host array
and ships it with one non-blocking H2D copy: from pageable memory the driver
stages the bytes before the call returns, so the host buffer may be reused at
once and no device synchronisation happens. Nothing is ever read back.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np
import torch

__all__ = ["PageTable", "find_kernel", "page_table_tensors", "update_req_to_token"]


class PageTable(NamedTuple):
    """FlashInfer CSR page table of a batch, int32 tensors on the pool's device."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


def find_kernel(name: str) -> Callable[..., Any] | None:
    """``kvpool.kernels.<name>`` if that module imports (Triton present), else None."""
    try:
        from kvpool import kernels  # imported lazily: CPU pools never pay for triton
    except Exception:  # noqa: BLE001 - any import failure means "use the torch path"
        return None
    return getattr(kernels, name, None)


def _to_device(host: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(host).to(device, non_blocking=True)


def update_req_to_token(
    req_to_token: torch.Tensor,
    rows: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    slots: np.ndarray,
    kernel: Callable[..., Any] | None,
) -> torch.Tensor:
    """Write ``slots`` into ``req_to_token[rows[i], starts[i]:starts[i]+counts[i]]``.

    One H2D copy, then one device write (the Triton kernel when given, else
    ``index_put_`` with flat indices built on the host). Returns the slots as a
    device int64 tensor (a view of the copied buffer) for ``out_cache_loc``.
    """
    n, b = slots.shape[0], rows.shape[0]
    offsets = np.cumsum(counts) - counts  # first index of each request's slots in `slots`
    if kernel is not None:
        # Host-computed offsets ride along in the same copy, sparing the kernel
        # its on-device prefix sum.
        # Each segment starts on a 16-byte boundary: Triton specializes pointer
        # arguments on 16-byte alignment, so segments at odd offsets would compile
        # new kernel variants mid-serving whenever a batch size changes parity.
        parts = (slots, rows, starts, counts, offsets)
        at = np.cumsum([0] + [(p.shape[0] + 1) & ~1 for p in parts])
        packed = np.empty(int(at[-1]), dtype=np.int64)
        for p, lo in zip(parts, at):
            packed[lo : lo + p.shape[0]] = p
        dev = _to_device(packed, req_to_token.device)
        slots_d, rows_d, starts_d, counts_d, offsets_d = (dev[lo : lo + p.shape[0]] for p, lo in zip(parts, at))
        kernel(req_to_token, rows_d, starts_d, counts_d, slots_d, offsets=offsets_d)
        return slots_d
    width = req_to_token.shape[1]
    flat = np.repeat(rows * width + starts - offsets, counts) + np.arange(n, dtype=np.int64)
    dev = _to_device(np.concatenate([slots, flat]), req_to_token.device)
    if n:
        req_to_token.view(-1).index_put_((dev[n:],), dev[:n].to(torch.int32))
    return dev[:n]


def page_table_tensors(
    indptr: np.ndarray, indices: np.ndarray, last: np.ndarray, device: torch.device
) -> PageTable:
    """The allocator's CSR arrays as device tensors (zero copy on CPU, one H2D copy on CUDA)."""
    if device.type == "cpu":
        return PageTable(torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last))
    a, b = indptr.shape[0], indices.shape[0]
    dev = _to_device(np.concatenate([indptr, indices, last]).astype(np.int32, copy=False), device)
    return PageTable(dev[:a], dev[a : a + b], dev[a + b :])
