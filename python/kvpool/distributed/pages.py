"""Page-granular views of a pool's K/V memory: runs, byte views, transfer descriptors.

Every cache kind of a pool is one allocation ``[num_layers, num_slots, H, D]``,
so page ``p`` of layer ``l`` is one contiguous block of
``page_size * H * D * itemsize`` bytes at byte offset
``(l * num_pages + p) * page_bytes`` of that allocation. These helpers give
those blocks as byte-tensor views (for torch.distributed packing) and as
``(addr, len, device_id)`` rows (the descriptors NIXL and Mooncake take; see
docs/distributed.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool.kernels.pages import _check_range, _ids
from kvpool.validate import check_flag, require_plain_pool

__all__ = ["cache_pages", "contiguous_runs", "page_bytes", "page_descriptors", "word_dtype"]


def word_dtype(nbytes: int) -> torch.dtype:
    """The widest integer dtype whose size divides ``nbytes``: CPU index_copy_ moves
    8-byte words ~20x faster than single bytes."""
    for dt in (torch.int64, torch.int32, torch.int16):
        if nbytes % dt.itemsize == 0:
            return dt
    return torch.uint8


def cache_pages(pool: Any) -> list[torch.Tensor]:
    """One view ``[num_layers, num_pages, page_words]`` per cache kind (K, V or the MLA
    latent), of ``word_dtype(page_bytes(pool))`` words: the raw bytes, whatever the dtype."""
    word = word_dtype(page_bytes(pool))
    out = []
    for _name, cache in pool._storage.tensors():
        # Flatten each layer before reinterpreting: a page is a whole number of words,
        # but one head's row (head_dim * itemsize bytes) need not be.
        layers = cache.view(cache.shape[0], -1).view(torch.uint8).view(word)
        out.append(layers.view(cache.shape[0], pool.num_pages, -1))
    return out


def page_bytes(pool: Any) -> int:
    """Bytes of one page of one layer of one cache kind."""
    return pool.page_size * pool.num_kv_heads * pool.head_dim * pool.dtype.itemsize


def contiguous_runs(pages: Any) -> tuple[np.ndarray, np.ndarray]:
    """Split page ids into maximal runs of consecutive ids: ``(starts, lengths)`` (int64)."""
    p = _ids(pages, "pages")
    if p.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    breaks = np.flatnonzero(np.diff(p) != 1) + 1
    starts_idx = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts_idx, [p.size])))
    return p[starts_idx], lengths.astype(np.int64)


def page_descriptors(pool: Any, pages: Any, *, merge: bool = True) -> np.ndarray:
    """Transfer descriptors of ``pages`` for every cache kind and layer.

    Returns int64 ``[n, 3]`` rows ``(addr, nbytes, device_id)``, ordered cache
    kind, then layer, then page run; ``device_id`` is the CUDA ordinal (0 on
    the host). ``merge=True`` joins consecutive page ids into one descriptor.
    Two pools with the same shape give rows that pair up one to one for the
    same page list, which is what NIXL's ``initialize_xfer`` and Mooncake's
    ``batch_transfer_sync_write`` need (docs/distributed.md).
    """
    # Checked here because the rows are raw addresses: a page past the pool would
    # send a transfer engine outside the allocation.
    # (A hybrid pool's layer groups each have their own pages and storage: no one address rule.)
    require_plain_pool(pool, "page_descriptors")
    merge = check_flag("merge", merge)
    ids = _ids(pages, "pages")
    _check_range(ids, "pages", pool.num_pages, "pool")
    if merge:
        starts, lengths = contiguous_runs(ids)
    else:
        starts, lengths = ids, np.ones_like(ids)
    pb = page_bytes(pool)
    dev = pool.device.index if pool.device.type == "cuda" and pool.device.index is not None else 0
    rows = []
    for _name, cache in pool._storage.tensors():
        base = cache.data_ptr()
        layer_bytes = pool.num_pages * pb
        for layer in range(cache.shape[0]):
            addr = base + layer * layer_bytes + starts * pb
            rows.append(np.stack([addr, lengths * pb, np.full_like(starts, dev)], axis=1))
    return np.concatenate(rows) if rows else np.zeros((0, 3), np.int64)
