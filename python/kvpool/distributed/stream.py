"""The K/V chunks of one transfer on the wire: everything a side allocates for them,
taken before the peer is told to go ahead; the sender packing and sending them two
buffers deep; the receiver storing them as they land.

Each chunk ends with a word (``chunks.seal``): its number, or ``ABORTED`` when the
sender failed while packing it. So a sender's failure after the handshake reaches
the receiver as an abort of this request, at once, with the channel still in step,
and a receive that got something else (a shorter message, a chunk out of order) is
refused instead of stored as K/V.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool.distributed.chunks import ABORTED, chunk_view, message, pack, rescale, seal, staging, trailer, unpack
from kvpool.distributed.errors import TransferError
from kvpool.distributed.pages import cache_pages

__all__ = ["ChunkBuffers", "chunk_buffers", "receive_pages", "send_pages"]

ChunkBuffers = tuple[list[torch.Tensor], Any, list[torch.Tensor]]


def chunk_buffers(device: torch.device, pool: Any, pages: np.ndarray, per_chunk: int) -> ChunkBuffers:
    """``(staging, page ids on the pool's device, the caches' page views)`` for moving
    ``pages`` in chunks of ``per_chunk``: what can fail for want of memory, taken before
    the peer commits (empty when there is nothing to move)."""
    if not len(pages):
        return [], None, []
    bufs = staging(device, pool, min(per_chunk, len(pages)), -(-len(pages) // per_chunk))
    return bufs, torch.from_numpy(pages).to(pool.device), cache_pages(pool)


def _chunks(n: int, per_chunk: int) -> list[tuple[int, int]]:
    return [(s, min(per_chunk, n - s)) for s in range(0, n, per_chunk)]


def send_pages(link: Any, pool: Any, buffers: ChunkBuffers, pages: np.ndarray, idx: Any, per_chunk: int) -> None:
    """Send ``pages`` (``idx``: the same ids on the pool's device) in chunks of ``per_chunk``.
    If packing a chunk fails (a device error), that chunk goes out marked ``ABORTED`` (the
    receiver closes its request and the channel stays in step) and the error is raised."""
    bufs, _, views = buffers
    in_flight: list[Any] = [None, None]
    for i, (start, k) in enumerate(_chunks(len(pages), per_chunk)):
        slot = i % 2
        buf = bufs[slot]
        if in_flight[slot] is not None:
            link.wait(in_flight[slot], "K/V chunk")
            in_flight[slot] = None
        try:
            pack(views, chunk_view(buf, pool, k), pages[start : start + k], idx[start : start + k])
            seal(buf, pool, k, i + 1)
        except BaseException as e:
            _abort(link, pool, buf, k, in_flight, e)
            raise
        in_flight[slot] = link.send(message(buf, pool, k), "K/V chunk")
    for w in in_flight:
        if w is not None:
            link.wait(w, "K/V chunk")


def _abort(link: Any, pool: Any, buf: torch.Tensor, k: int, in_flight: list[Any], error: BaseException) -> None:
    """Send the chunk that failed to pack as ``ABORTED``, after the chunks before it."""
    try:
        for w in in_flight:
            if w is not None:
                link.wait(w, "K/V chunk")
        try:
            seal(buf, pool, k, ABORTED)
        except BaseException:  # noqa: BLE001 - unsealed, the word is a stale number: refused all the same
            pass
        link.wait(link.send(message(buf, pool, k), "K/V chunk (abort)"), "K/V chunk (abort)")
        note = "the receiver was told to abort (it closes the request it opened for it)"
    except BaseException as e:  # noqa: BLE001 - the packing error is the one to raise
        note = f"telling the receiver failed too ({str(e)[:200]}); it fails at its timeout"
    if hasattr(error, "add_note"):  # (Python 3.11+)
        error.add_note(f"kvpool send_request: packing K/V for rank {link.peer} failed after it had agreed to take "
                       f"the request; {note}. This pool is unchanged")


def receive_pages(link: Any, pool: Any, buffers: ChunkBuffers, pages: np.ndarray, idx: Any, per_chunk: int,
                  src_scales: np.ndarray) -> Exception | None:
    """Store the chunks ``send_pages`` sends into ``pages`` (``idx``: on the pool's device),
    the next one landing in the other buffer while one is stored. Raises ``TransferError``
    for a chunk the sender aborted or one that is not the next (nothing of it stored).
    Returns the error of a chunk this side failed to store (a device out of memory
    rescaling or unpacking it), once the remaining chunks have been taken off the channel
    unstored, so that the caller can tell the sender (a FAILED ack); else None."""
    bufs, _, views = buffers
    parts = _chunks(len(pages), per_chunk)

    def post(i: int) -> Any:
        buf, k = bufs[i % 2], parts[i][1]
        seal(buf, pool, k, 0)  # no chunk is numbered 0: a receive that leaves the word unwritten is caught
        return link.post_recv(message(buf, pool, k), "K/V chunk")

    failed: Exception | None = None
    pending = post(0) if parts else None
    for i, (start, k) in enumerate(parts):
        link.wait(pending, "K/V chunk")
        buf = bufs[i % 2]
        word = trailer(buf, pool, k)
        if word != i + 1:
            raise _refused_chunk(link.peer, i, len(parts), word)
        if i + 1 < len(parts):
            pending = post(i + 1)
        if failed is not None:
            continue  # taken off the channel, not stored: the request is closed anyway
        try:
            view = chunk_view(buf, pool, k)
            rescale(pool, view, src_scales)
            unpack(views, view, pages[start : start + k], idx[start : start + k])
        except Exception as e:  # noqa: BLE001 - raised once the sender has sent everything
            failed = e
    return failed


def _refused_chunk(peer: int, i: int, n: int, word: int) -> TransferError:
    if word == ABORTED:
        return TransferError(f"rank {peer} failed while sending K/V chunk {i + 1} of {n} and aborted the transfer "
                             f"(see its error); the request opened for it was closed")
    return TransferError(
        f"K/V chunk {i + 1} of {n} from rank {peer} arrived incomplete or out of step (its closing word reads "
        f"{word}, expected {i + 1}): the sender stopped without aborting, or another message came in its place; "
        f"the request opened for it was closed")
