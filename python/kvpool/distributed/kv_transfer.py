"""Move a request's K/V from one pool to another over torch.distributed (send/recv).

Protocol (src = the pool that has the request, dst = the pool that takes it):

  1. src -> dst  header   int64[18]: shape of the pool, request length and page
                          count, how many chain hashes and fp8 scales follow,
                          the request's salt (kept with no chain too)
  2. src -> dst  meta     int64 (only if non-empty): for n chain pages, 2n hash
                          words (hi, lo), the salt and n * page_size token ids;
                          then the fp8 scales
  3. dst -> src  reply    int64[6]: status, leading pages dst already has cached,
                          its free pages, pages it needs. dst has opened the
                          request and taken its pages only if status is OK
  4. src -> dst  data     ceil(pages_to_send / pages_per_chunk) chunks, each
                          ``[caches, layers, pages, page_bytes]`` uint8 (K/V of
                          every layer, packed page by page), then one int64 word
                          at the next 8-byte boundary: the chunk's number from 1,
                          or -1 when src failed packing it (dst then closes the
                          request; ``kvpool.distributed.stream``)
  5. dst -> src  ack      int64[2]

So a request costs 4 + chunks messages whatever its length or layer count, and
nothing big moves before dst has agreed. Every wait has a timeout, so a dead or
silent peer surfaces as ``TransferError`` / ``TransferTimeoutError``. Failure
leaves both pools as they were: src only reads; dst rejects before opening
anything when it has no room or the header is malformed (checked field by field
against its own pool, see ``kvpool.distributed.protocol``), and closes the
half-received request otherwise. Each side allocates its staging before dst
replies, so that after the reply only packing (sent as an abort) and the link
itself can fail. Each side holds its pool's lock while it
holds the request's pages.

The send side is here; the receive side (``recv_request``, ``recv_request_stats``,
re-exported here) is ``kvpool.distributed.kv_receive``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvpool._core import InvalidArgumentError
from kvpool.distributed.both_sides import TransferStats, _pool_lock
from kvpool.distributed.chunks import DEFAULT_CHUNK_BYTES
from kvpool.distributed.comm import DEFAULT_TIMEOUT_S, bad_timeout, check_peer, comm_device
from kvpool.distributed.comm import Link as _Link  # (tests replace kv_transfer._Link)
from kvpool.distributed.errors import TransferError, TransferRejectedError
from kvpool.distributed.kv_receive import recv_request, recv_request_stats  # noqa: F401 - recv_request_stats: kvpool.distributed imports it from here
from kvpool.distributed.pages import page_bytes
from kvpool.distributed.protocol import (
    CONTEXT,
    EXHAUSTED,
    FAILED,
    H_ABORT,
    H_HASHES,
    H_LENGTH,
    H_MAGIC,
    H_PAGES,
    H_PER_CHUNK,
    H_SALT,
    H_SCALES,
    H_VERSION,
    HEADER_LEN,
    INCOMPATIBLE,
    MAGIC,
    MALFORMED,
    OK,
    REASONS,
    REPLY_LEN,
    TOO_MANY,
    VERSION,
    chain_of,
    reply_problem,
    shape_fields,
    unsupported,
)
from kvpool.distributed.protocol import scales as scales_of
from kvpool.distributed.stream import chunk_buffers, send_pages
from kvpool.validate import check_pool, is_int

__all__ = ["TransferStats", "send_request", "recv_request", "DEFAULT_CHUNK_BYTES"]


def send_request(pool: Any, handle: int, dst_rank: int, group: Any = None, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> TransferStats:
    """Send request ``handle``'s K/V (every layer, fp8 scales) to the pool on ``dst_rank``.

    The peer must call ``recv_request`` with this rank as source. The request
    stays open here (close it when the engine no longer needs it). Pages the
    destination already has cached (matched by chain hash) are not sent.

    Raises ``TransferRejectedError`` when the destination refuses (no room:
    ``reason="exhausted"``; a different pool shape: ``"incompatible"``);
    ``TransferError`` / ``TransferTimeoutError`` when the peer dies or stays
    silent for ``timeout_s`` seconds; ``InvalidHandleError`` for a stale
    handle and ``InvalidArgumentError`` for a ``timeout_s`` (at most 1e9 s) or
    ``chunk_bytes`` that is not a positive number (the destination is told to
    abort in both cases), or, before any message, for a ``pool`` that is not a
    pool, no process group or a ``dst_rank`` that is not another rank of
    ``group``; ``TransferError`` for a reply no ``recv_request`` writes. This
    pool is never changed.
    """
    check_pool(pool, "send_request", ("device",))  # (no peer to tell: refused before any message)
    check_peer(dst_rank, group, "dst_rank")
    bad = _bad_send_args(timeout_s, chunk_bytes) or unsupported(pool)
    if bad is not None:
        timeout_s = DEFAULT_TIMEOUT_S  # (the abort header still goes out, with the default)
    # The request's pages are read from the first query to the last chunk: no other
    # thread may close it and hand its pages out meanwhile.
    with _pool_lock(pool):
        return _send_request(pool, handle, dst_rank, group, timeout_s, chunk_bytes, bad)


def _bad_send_args(timeout_s: Any, chunk_bytes: Any) -> str | None:
    """What is wrong with ``send_request``'s keyword arguments, or None."""
    if not is_int(chunk_bytes) or chunk_bytes < 1:
        return bad_timeout(timeout_s) or f"chunk_bytes must be a positive int, got {chunk_bytes!r}"
    return bad_timeout(timeout_s)


def _send_request(pool: Any, handle: int, dst_rank: int, group: Any, timeout_s: float,
                  chunk_bytes: int, bad: str | None = None) -> TransferStats:
    t0 = time.perf_counter()
    link = _Link(dst_rank, group, comm_device(group, pool.device), timeout_s)
    header = np.zeros(HEADER_LEN, np.int64)
    header[H_MAGIC], header[H_VERSION] = MAGIC, VERSION
    try:
        if bad is not None:
            raise InvalidArgumentError(bad)
        length = int(pool.length(handle))
        pages = np.asarray(pool.pages(handle), dtype=np.int64)
        n_chain, chain, salt = chain_of(pool, handle)
        scales = scales_of(pool)
        per_row = (1 if pool.mla else 2) * pool.num_layers * page_bytes(pool)
        per_chunk = max(1, min(len(pages), chunk_bytes // per_row)) if len(pages) else 1
        for k, v in shape_fields(pool).items():
            header[k] = v
        # Staging for every page (the receiver may cache none): after its reply only
        # packing and the link can fail, and a failed pack is sent as an abort.
        buffers = chunk_buffers(link.device, pool, pages, per_chunk)
    except Exception:
        # Any error before the header (typed or not) still tells the receiver, which would
        # otherwise wait out its timeout or take this rank's next transfer as this one.
        header[H_ABORT] = 1  # let the receiver fail now instead of at its timeout
        link.send_ints(header, "abort header")
        raise
    header[H_LENGTH], header[H_PAGES], header[H_HASHES] = length, len(pages), n_chain
    header[H_SCALES], header[H_PER_CHUNK] = len(scales), per_chunk
    header[H_SALT] = salt
    link.send_ints(header, "header")
    if len(chain) + len(scales):
        link.send_ints(np.concatenate([chain, scales.view(np.int64)]), "chain hashes and scales")
    reply = link.recv_ints(REPLY_LEN, "reply")
    status, cached, free, need = (int(x) for x in reply[:4])
    if (why := reply_problem(status, cached, n_chain)) is not None:  # then sending would go wrong
        raise TransferError(f"rank {dst_rank} sent a malformed reply: {why}; is it running recv_request of this "
                            f"kvpool version? Nothing was sent")
    if status != OK:
        reason = REASONS.get(status, f"status {status}")
        detail = {
            EXHAUSTED: _no_room(need, length, free, cached),
            TOO_MANY: "every request row of its pool is open",
            CONTEXT: f"{length} tokens exceed its max_context_len {int(reply[4])}",
            INCOMPATIBLE: "its pool has another shape, page size, dtype or head shard, or fp8 scales it cannot "
                          "receive with (see its error)",
            MALFORMED: "it found this transfer's header or metadata malformed (see its error)",
            FAILED: "it failed opening the request or allocating its staging (see its error, e.g. a device out "
                    "of memory)",
        }.get(status, "")
        # A receiver that failed after its open closed the request again: its matched cached pages
        # are back as they were but count as just used (their place in the eviction order).
        after = ("no request is open on either side (the receiver's matched cached pages count as just used)"
                 if status == FAILED else "both pools are unchanged")
        raise TransferRejectedError(
            f"rank {dst_rank} refused request {handle:#x} ({reason}): {detail}; nothing was sent and {after}",
            reason=reason)
    todo = pages[cached:]
    if not len(todo):
        return _acknowledged(link, dst_rank, handle, pages, cached, 0, t0)
    send_pages(link, pool, buffers, todo, buffers[1][cached:], per_chunk)
    return _acknowledged(link, dst_rank, handle, pages, cached, len(todo) * per_row, t0)


def _no_room(need: int, length: int, free: int, cached: int) -> str:
    """Why a receiver had no room: its count, and when it already caches leading pages,
    that ``need`` is beyond them and that holding them takes them out of ``free``."""
    beyond = f" beyond the {cached} leading pages it already caches" if cached > 0 else ""
    if cached > 0 and need <= free:  # refused once holding the cached pages, which its free count had in it
        return (f"it needs {need} free pages for {length} tokens{beyond}, and has fewer once it holds "
                f"those: its {free} free pages counted the cached ones no request held")
    return f"it needs {need} free pages for {length} tokens{beyond} but has {free}"


def _acknowledged(link: _Link, dst_rank: int, handle: int, pages: np.ndarray, cached: int, moved: int,
                  t0: float) -> TransferStats:
    """Wait for the receiver's ack of the ``len(pages) - cached`` pages sent."""
    sent = len(pages) - cached
    ack = link.recv_ints(2, "ack")
    if int(ack[0]) == FAILED:
        raise TransferError(f"rank {dst_rank} failed storing the K/V of request {handle:#x} (see its error: a device "
                            f"out of memory) and closed the request it opened; this pool is unchanged")
    if int(ack[0]) != OK or int(ack[1]) != sent:
        raise TransferError(f"rank {dst_rank} acknowledged {int(ack[1])} of {sent} pages (status {int(ack[0])})")
    return TransferStats(int(handle), len(pages), cached, moved, link.messages, time.perf_counter() - t0)
