"""K/V pages packed into the staging chunks ``kv_transfer`` sends and receives:
the staging buffers (kept per pool between transfers, up to a bound), the pack
and unpack of a chunk's pages, and the fp8 rescale of received rows."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from kvpool.distributed.pages import contiguous_runs, page_bytes, word_dtype
from kvpool.distributed.protocol import scales as scales_of
from kvpool.modes import persistent, register_kept_for_pool

DEFAULT_CHUNK_BYTES = 16 << 20  # staging per buffer; big enough to amortize a message, small enough to pipeline
#: Staging kept per pool between transfers (both buffers); bigger staging is freed after its transfer.
KEEP_STAGING_BYTES = 2 * DEFAULT_CHUNK_BYTES

STAGING: weakref.WeakKeyDictionary[Any, list[torch.Tensor]] = weakref.WeakKeyDictionary()


def _kept(pool: Any) -> list[tuple[str, torch.Tensor]]:
    """audit(pool)'s view of the staging kept for ``pool`` (``staging``'s key)."""
    return [(f"transfer_staging[{i}]", t) for i, t in enumerate(STAGING.get(getattr(pool, "inner", pool)) or ())]


register_kept_for_pool(_kept)


#: A chunk message ends with one int64 word after its pages (at the next 8-byte boundary):
#: the chunk's number counted from 1, or ``ABORTED`` when the sender failed while packing
#: it. The receiver zeroes that word before each receive, so a shorter message (gloo
#: completes a receive with one: another transfer's header, after a sender gave up without
#: a word) or a chunk out of order is refused rather than stored as K/V.
ABORTED = -1
TRAILER_BYTES = 8


def _trailer_at(pool: Any, pages: int) -> int:
    body = (1 if pool.mla else 2) * pool.num_layers * pages * page_bytes(pool)
    return (body + 7) & ~7


def message(buf: torch.Tensor, pool: Any, pages: int) -> torch.Tensor:
    """The bytes sent (or received) for a chunk of ``pages`` pages: its pages, then its word."""
    return buf[: _trailer_at(pool, pages) + TRAILER_BYTES]


def seal(buf: torch.Tensor, pool: Any, pages: int, word: int) -> None:
    """Set the word after a chunk of ``pages`` pages (a staging buffer starts 8-byte aligned)."""
    at = _trailer_at(pool, pages)
    buf[at : at + TRAILER_BYTES].view(torch.int64).fill_(word)


def trailer(buf: torch.Tensor, pool: Any, pages: int) -> int:
    """The word after a received chunk of ``pages`` pages."""
    at = _trailer_at(pool, pages)
    return int(buf[at : at + TRAILER_BYTES].view(torch.int64).item())


def staging(device: torch.device, pool: Any, pages: int, chunks: int) -> list[torch.Tensor]:
    """Buffers for chunks of ``pages`` pages: two when there are several chunks (one
    being sent or stored while the other is filled), else one. So staging never
    exceeds the pages actually moved, which the receiver has checked against its
    free pages. Up to ``KEEP_STAGING_BYTES`` stay with the pool, so repeated
    transfers do not pay for fresh allocations and page faults; bigger buffers are
    freed when the transfer returns (the caller holds the only reference)."""
    n = _trailer_at(pool, pages) + TRAILER_BYTES
    count = 2 if chunks > 1 else 1
    owner = getattr(pool, "inner", pool)
    kept = STAGING.get(owner)
    if kept is not None and len(kept) >= count and kept[0].numel() >= n and kept[0].device == device:
        return kept
    keep = n * 2 <= KEEP_STAGING_BYTES
    # A kept staging is always a pair, so a later transfer of several chunks reuses it too.
    with persistent():
        bufs = [torch.empty(n, dtype=torch.uint8, device=device) for _ in range(2 if keep else count)]
    if keep:
        STAGING[owner] = bufs
    else:
        STAGING.pop(owner, None)
    return bufs


#: Above this many contiguous page runs per request, pages are packed with one
#: index op per cache kind instead of one copy per run.
MAX_RUNS = 32


def pack(views: list[torch.Tensor], chunk: torch.Tensor, pages: np.ndarray, idx: torch.Tensor) -> None:
    """Copy pages (all layers) of every cache into ``chunk`` ``[caches, layers, k, words]``."""
    starts, lengths = contiguous_runs(pages)
    for c, cache in enumerate(views):
        if len(starts) <= MAX_RUNS:
            off = 0
            for s, n in zip(starts.tolist(), lengths.tolist()):
                chunk[c, :, off : off + n].copy_(cache[:, s : s + n])
                off += n
        elif cache.device == chunk.device:
            torch.index_select(cache, 1, idx, out=chunk[c])
        else:
            chunk[c].copy_(cache.index_select(1, idx))


def unpack(views: list[torch.Tensor], chunk: torch.Tensor, pages: np.ndarray, idx: torch.Tensor) -> None:
    """The inverse of ``pack``: store ``chunk``'s pages into the caches."""
    starts, lengths = contiguous_runs(pages)
    for c, cache in enumerate(views):
        if len(starts) <= MAX_RUNS:
            off = 0
            for s, n in zip(starts.tolist(), lengths.tolist()):
                cache[:, s : s + n].copy_(chunk[c, :, off : off + n])
                off += n
        else:
            cache.index_copy_(1, idx, chunk[c].to(cache.device))


def chunk_view(buf: torch.Tensor, pool: Any, k: int) -> torch.Tensor:
    """``[caches, layers, k, page_words]`` at the start of a staging buffer (contiguous)."""
    caches = 1 if pool.mla else 2
    word = word_dtype(page_bytes(pool))
    return buf[: caches * pool.num_layers * k * page_bytes(pool)].view(word).view(caches, pool.num_layers, k, -1)


def rescale(pool: Any, view: torch.Tensor, src_scales: np.ndarray) -> None:
    """fp8: re-quantize rows stored with the sender's scales to this pool's scales, in place."""
    if not len(src_scales):
        return
    mine = scales_of(pool)
    if np.array_equal(mine, src_scales):
        return
    fmax = torch.finfo(pool.dtype).max
    L = pool.num_layers
    for c in range(view.shape[0]):
        for layer in range(L):
            ratio = float(src_scales[c * L + layer] / mine[c * L + layer])
            if ratio == 1.0:
                continue
            rows = view[c, layer].view(pool.dtype)
            q = (rows.float() * ratio).clamp_(-fmax, fmax).to(pool.dtype)
            view[c, layer].copy_(q.view(view.dtype))
