"""The receive side of a request transfer (``recv_request``; the protocol is in
``kvpool.distributed.kv_transfer``'s module doc): the header checked against this pool
before anything is allocated, the request opened on the pages its prefix cache already
holds, the chunks stored, and any refusal told to the sender at once, any failure after
the open undone here."""

from __future__ import annotations

import contextlib
import inspect
import time
from typing import Any

import numpy as np
import torch

from kvpool._core import ContextTooLongError, InvalidArgumentError, KVPoolError, PoolExhaustedError, TooManyRequestsError
from kvpool.distributed.both_sides import TransferStats, _pool_lock
from kvpool.distributed.comm import DEFAULT_TIMEOUT_S, bad_timeout, check_peer, comm_device, wait
from kvpool.distributed.comm import Link as _Link  # (tests replace kv_receive._Link)
from kvpool.distributed.errors import TransferError, TransferRejectedError
from kvpool.distributed.pages import page_bytes
from kvpool.distributed.protocol import (
    CONTEXT,
    EXHAUSTED,
    FAILED,
    H_ABORT,
    H_HASHES,
    H_LENGTH,
    H_MAGIC,
    H_PAGE,
    H_PAGES,
    H_PER_CHUNK,
    H_SALT,
    H_SCALES,
    H_VERSION,
    HEADER_LEN,
    INCOMPATIBLE,
    MAGIC,
    MALFORMED,
    MAX_FOREIGN_META_WORDS,
    OK,
    TOO_MANY,
    VERSION,
    chain_words,
    header_problem,
    incompatible,
    meta_words,
    split_chain,
    unsupported,
)
from kvpool.distributed.protocol import scales as scales_of
from kvpool.distributed.stream import chunk_buffers, receive_pages
from kvpool.validate import check_pool

__all__ = ["recv_request", "recv_request_stats"]

#: Longest a receiver waits to deliver a refusal to a sender whose header it could
#: not even read through (the sender may be stuck sending metadata it never takes).
REFUSAL_WAIT_S = 2.0


def _prefix_match(pool: Any, chain: tuple[np.ndarray, np.ndarray, int], max_pages: int) -> int:
    """Prefix hook: how many leading pages of the sender's chain this pool already caches
    (verified by their tokens and salt in the core, so a hash alone never matches)."""
    fn = getattr(pool, "match_chain_hashes", None)
    hashes, tokens, salt = chain
    if fn is None or not len(hashes) or not hasattr(pool, "open_with_chain_hashes"):
        return 0
    return max(0, min(int(fn(hashes, tokens, salt)), max_pages, len(hashes) // 2))


def _takes_length(fn: Any) -> bool:
    """Whether ``open_with_chain_hashes`` can open and extend in one call (``length=``)."""
    try:
        return "length" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: assume the older call
        return False


def _open(pool: Any, chain: tuple[np.ndarray, np.ndarray, int], cached: int, length: int) -> int:
    """Open the destination request: the cached leading pages shared, the rest fresh.
    With a chain, its tokens become the request's known prompt (so ``cache()`` can
    register the received pages later)."""
    hashes, tokens, salt = chain
    # With no chain pages, a salted request is still opened through the chain call, which
    # takes an empty chain and gives the request the sender's salt (a plain open gives it 0:
    # its later registrations would serve another tenant).
    opener = getattr(pool, "open_with_chain_hashes", None) if len(hashes) or salt else None
    if opener is not None and _takes_length(opener):
        # One atomic call: holding the matched pages takes the evictable ones out of
        # the room, which only the core counts right. An open and extend that failed
        # would close again, moving the matched pages to the newest end of the
        # eviction order (a refusal must leave the pool exactly as it was).
        return int(opener(hashes, tokens, salt, max_pages=cached, length=length))
    if opener is not None:
        handle = int(opener(hashes, tokens, salt, max_pages=cached))
        if int(pool.length(handle)) != cached * pool.page_size:  # pragma: no cover - nothing ran in between
            pool.close([handle])
            raise TransferError("the prefix cache changed between the match and the open")
    else:
        handle = int(pool.open(1)[0])
    try:
        pool.extend([handle], length - cached * pool.page_size)
    except BaseException:
        pool.close([handle])
        raise
    return handle


def recv_request(pool: Any, src_rank: int, group: Any = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """Receive a request sent by ``send_request`` on ``src_rank``; return its handle here.

    Opens a request of the same length, takes this pool's own pages (sharing
    any leading pages its prefix cache already holds), and fills them with the
    sender's K/V for every layer; fp8 rows are rescaled when the two pools'
    scales differ. Raises ``PoolExhaustedError`` / ``TooManyRequestsError`` /
    ``ContextTooLongError`` when the request does not fit (the sender gets
    ``TransferRejectedError``; both pools unchanged), ``TransferRejectedError``
    for a pool of another shape (``reason="incompatible"``) or a header that
    no correct sender would write (``reason="malformed"``: every field is
    checked against this pool's geometry before anything is allocated, and
    the sender is refused at once), and ``TransferError`` /
    ``TransferTimeoutError`` when the sender dies, aborts or stays silent for
    ``timeout_s`` (the half-received request is closed again).
    ``InvalidArgumentError``, before any message, for a ``timeout_s`` that is not
    a positive number (at most 1e9 s), a ``pool`` that is not a pool, no process
    group or a ``src_rank`` that is not another rank of ``group``.
    """
    return recv_request_stats(pool, src_rank, group, timeout_s=timeout_s).handle


def recv_request_stats(pool: Any, src_rank: int, group: Any = None, *,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> TransferStats:
    """``recv_request`` returning the full ``TransferStats`` (benchmarks)."""
    if (bad := bad_timeout(timeout_s)) is not None:  # (before any message: the sender times out)
        raise InvalidArgumentError(bad)
    check_pool(pool, "recv_request", ("device",))
    check_peer(src_rank, group, "src_rank")
    t0 = time.perf_counter()
    link = _Link(src_rank, group, comm_device(group, pool.device), timeout_s)
    header = link.recv_ints(HEADER_LEN, "header")
    if int(header[H_MAGIC]) != MAGIC:
        raise TransferError(f"rank {src_rank} sent no kvpool transfer header (magic "
                            f"{int(header[H_MAGIC]):#x}); is it running send_request?")
    if int(header[H_ABORT]):
        raise TransferError(f"rank {src_rank} aborted the transfer before sending (see its error: an invalid "
                            f"or swapped-out handle, a bad argument or a pool that cannot send)")
    if (why := unsupported(pool)) is not None:
        raise _refuse_unsupported(link, header, why, timeout_s)

    def refuse(status: int, error: Exception, need: int = 0, extra: int = 0, patient: bool = True,
               cached: int = 0) -> Exception:
        """Tell the sender (so it fails now, not at its timeout), then hand back ``error``.
        ``cached``: for EXHAUSTED, the leading pages this pool caches (``need`` is beyond them)."""
        try:
            reply = torch.from_numpy(np.array([status, cached, int(pool.free_pages), need, extra, 0], np.int64))
            wait(link.send(reply.to(link.device), "refusal"), timeout_s if patient else min(timeout_s, REFUSAL_WAIT_S),
                 "refusal", src_rank)
        except TransferError:
            pass  # the error below says what was wrong; the sender is told what it can be
        return error

    def malformed(why: str) -> TransferRejectedError:
        return TransferRejectedError(
            f"rank {src_rank} sent a malformed transfer header: {why}. Nothing was allocated or opened; "
            f"the sender was refused", reason="malformed")

    if int(header[H_VERSION]) != VERSION:
        raise refuse(MALFORMED, malformed(f"protocol version {int(header[H_VERSION])}, this side speaks "
                                          f"{VERSION}"), patient=False)
    n_meta, why = meta_words(pool, header)
    if n_meta < 0:  # never read: the claim itself is the problem
        raise refuse(MALFORMED, malformed(why), patient=False)
    meta = link.recv_ints(n_meta, "chain hashes and scales") if n_meta else np.zeros(0, np.int64)
    diff = incompatible(pool, header)
    if diff:
        raise refuse(INCOMPATIBLE, TransferRejectedError(
            f"request from rank {src_rank} does not fit this pool's shape ({diff}); both pools need the "
            f"same page size, layers, head shard, total KV heads, head_dim and dtype", reason="incompatible"))
    n_hashes, n_scales = int(header[H_HASHES]), int(header[H_SCALES])
    src_scales = meta[n_meta - n_scales :].view(np.float64)
    if n_scales and not (np.isfinite(own := scales_of(pool)).all() and (own > 0).all()):
        # The rows are re-quantized to this pool's scales: by 0 they would read as 0 or inf.
        raise refuse(INCOMPATIBLE, TransferRejectedError(
            f"request from rank {src_rank}: this pool's own fp8 scales are not all finite and positive; set its "
            "k_scale / v_scale in place before it receives", reason="incompatible"))
    problem = header_problem(pool, header, src_scales)
    if problem is not None:
        status, why = problem
        if status == CONTEXT:
            raise refuse(CONTEXT, ContextTooLongError(f"received request: {why}"), extra=int(pool.max_context_len))
        raise refuse(status, malformed(why))
    chain = split_chain(meta[: n_meta - n_scales], n_hashes, int(header[H_SALT]))
    if n_hashes and chain[2] != int(header[H_SALT]):
        raise refuse(MALFORMED, malformed(f"salt {int(header[H_SALT])} in the header but {chain[2]} in the chain"))
    length, n_pages, per_chunk = int(header[H_LENGTH]), int(header[H_PAGES]), int(header[H_PER_CHUNK])
    P = pool.page_size
    # From here pages are taken and filled: no other thread's reset or eviction may
    # hand them out before the last chunk has landed.
    with _pool_lock(pool):
        try:
            cached = _prefix_match(pool, chain, min(n_pages, length // P))
        except KVPoolError as e:  # the chain's token ids or salt are out of range
            raise refuse(MALFORMED, malformed(str(e))) from None
        need = -(-length // P) - cached
        if need > pool.free_pages:
            raise refuse(EXHAUSTED, PoolExhaustedError(
                f"cannot receive a request of {length} tokens from rank {src_rank}: needs {need} pages "
                f"({need * P} slots) but only {pool.free_pages} pages ({pool.free_slots} slots) are free"),
                need=need, cached=cached)
        counted = _counted_hits(pool)
        try:
            handle = _open(pool, chain, cached, length)
        except PoolExhaustedError as e:  # (free_pages counted the matched pages no request held)
            raise refuse(EXHAUSTED, e, need=need, cached=cached) from None
        except TooManyRequestsError as e:
            raise refuse(TOO_MANY, e) from None
        except ContextTooLongError as e:
            raise refuse(CONTEXT, e, extra=int(pool.max_context_len)) from None
        except KVPoolError as e:
            raise refuse(MALFORMED, malformed(str(e))) from None
        except Exception as e:  # (a device OOM writing the table: the open closed itself) tell the sender now
            raise refuse(FAILED, e) from None
        try:
            dst_pages = np.asarray(pool.pages(handle), dtype=np.int64)[cached:]
            buffers = chunk_buffers(link.device, pool, dst_pages, per_chunk)
        except BaseException as e:  # (a torch OOM): the sender is told before it sends a byte
            _close_unreceived(pool, handle, counted)
            raise refuse(FAILED, e) from None
        try:
            link.send_ints([OK, cached, int(pool.free_pages), need, 0, 0], "reply")
            failed = receive_pages(link, pool, buffers, dst_pages, buffers[1], per_chunk, src_scales)
            if failed is None:
                link.send_ints([OK, len(dst_pages)], "ack")
        except BaseException:
            _close_unreceived(pool, handle, counted)
            raise
        if failed is not None:  # every chunk came: the sender, waiting for the ack, is told at once
            _close_unreceived(pool, handle, counted)
            with contextlib.suppress(TransferError):
                link.send_ints([FAILED, 0], "ack")
            raise failed
    moved = len(dst_pages) * (1 if pool.mla else 2) * pool.num_layers * page_bytes(pool)
    return TransferStats(handle, n_pages, cached, moved, link.messages, time.perf_counter() - t0)


def _counted_hits(pool: Any) -> Any:
    """The pool's hit counters before an open this call may undo (None: a pool without them)."""
    fn = getattr(getattr(pool, "inner", pool), "_counted_hits", None)
    return fn() if fn is not None else None


def _close_unreceived(pool: Any, handle: int, counted: Any) -> None:
    """Close the request opened for a transfer that failed: it served no prompt, so the
    hit counters take back what its open counted (as KVPool's own undone opens do)."""
    pool.close([handle])
    if counted is not None:
        getattr(pool, "inner", pool)._uncount_since(counted)


def _refuse_unsupported(link: _Link, header: np.ndarray, why: str, timeout_s: float) -> TransferRejectedError:
    """Refuse a transfer this pool cannot take at all, as an incompatible pool: the
    metadata is taken off the channel when a foreign pool would take it (so the
    group stays usable), and the sender is told at once."""
    n_meta = chain_words(int(header[H_HASHES]), max(1, int(header[H_PAGE]))) + int(header[H_SCALES])
    patient = int(header[H_HASHES]) >= 0 and int(header[H_SCALES]) >= 0 and n_meta <= MAX_FOREIGN_META_WORDS
    try:
        if patient and n_meta:
            link.recv_ints(n_meta, "chain hashes and scales")
        reply = torch.from_numpy(np.array([INCOMPATIBLE, 0, 0, 0, 0, 0], np.int64)).to(link.device)
        wait(link.send(reply, "refusal"), timeout_s if patient else min(timeout_s, REFUSAL_WAIT_S), "refusal",
             link.peer)
    except TransferError:
        pass  # the error below says what is wrong here
    return TransferRejectedError(f"cannot receive a request from rank {link.peer}: {why}", reason="incompatible")
