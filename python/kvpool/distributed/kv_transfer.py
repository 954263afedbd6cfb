"""Move a request's K/V from one pool to another over torch.distributed (send/recv).

Protocol (src = the pool that has the request, dst = the pool that takes it):

  1. src -> dst  header   int64[16]: shape of the pool, request length and page
                          count, how many chain hashes and fp8 scales follow
  2. src -> dst  meta     int64 (only if non-empty): for n chain pages, 2n hash
                          words (hi, lo), the salt and n * page_size token ids;
                          then the fp8 scales
  3. dst -> src  reply    int64[6]: status, leading pages dst already has cached,
                          its free pages, pages it needs. dst has opened the
                          request and taken its pages only if status is OK
  4. src -> dst  data     ceil(pages_to_send / pages_per_chunk) chunks, each
                          ``[caches, layers, pages, page_bytes]`` uint8 (K/V of
                          every layer, packed page by page)
  5. dst -> src  ack      int64[2]

So a request costs 4 + chunks messages whatever its length or layer count, and
nothing big moves before dst has agreed. Every wait has a timeout, so a dead or
silent peer surfaces as ``TransferError`` / ``TransferTimeoutError``. Failure
leaves both pools as they were: src only reads; dst rejects before opening
anything when it has no room, and closes the half-received request otherwise.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from kvpool._core import ContextTooLongError, KVPoolError, PoolExhaustedError, TooManyRequestsError
from kvpool.distributed.comm import DEFAULT_TIMEOUT_S, comm_device, wait
from kvpool.distributed.errors import TransferError, TransferRejectedError
from kvpool.distributed.pages import cache_pages, contiguous_runs, page_bytes, word_dtype
from kvpool.torch_types import FP8_DTYPES
from kvpool.modes import persistent

__all__ = ["TransferStats", "send_request", "recv_request", "DEFAULT_CHUNK_BYTES"]

MAGIC, VERSION = 0x6B76706F6F6C, 2
TAG = 0x4B56
HEADER_LEN, REPLY_LEN = 16, 6
DEFAULT_CHUNK_BYTES = 16 << 20  # staging per buffer; big enough to amortize a message, small enough to pipeline
OK, EXHAUSTED, TOO_MANY, CONTEXT, INCOMPATIBLE = range(5)
REASONS = {EXHAUSTED: "exhausted", TOO_MANY: "too_many_requests", CONTEXT: "context_too_long",
           INCOMPATIBLE: "incompatible"}
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2")
# Header fields, by index.
(H_MAGIC, H_VERSION, H_LENGTH, H_PAGE, H_LAYERS, H_HEADS, H_DIM, H_DTYPE, H_CACHES, H_PAGES,
 H_HASHES, H_SCALES, H_PER_CHUNK, H_PAGE_BYTES, H_HEAD_START, H_ABORT) = range(HEADER_LEN)


class TransferStats(NamedTuple):
    """What one transfer did: ``handle`` (the request on dst; src: the one sent),
    ``pages`` of the request, ``cached_pages`` dst already had (not sent),
    ``bytes`` of K/V moved, ``messages`` sent and received, ``seconds`` taken."""

    handle: int
    pages: int
    cached_pages: int
    bytes: int
    messages: int
    seconds: float


def _dtype_code(dtype: torch.dtype) -> int:
    name = str(dtype).replace("torch.", "")
    return DTYPE_NAMES.index(name) if name in DTYPE_NAMES else len(DTYPE_NAMES)


def _shape_fields(pool: Any) -> dict[int, int]:
    return {H_PAGE: pool.page_size, H_LAYERS: pool.num_layers, H_HEADS: pool.num_kv_heads,
            H_DIM: pool.head_dim, H_DTYPE: _dtype_code(pool.dtype), H_CACHES: 1 if pool.mla else 2,
            H_PAGE_BYTES: page_bytes(pool), H_HEAD_START: int(getattr(pool, "kv_head_start", 0))}


def _scales(pool: Any) -> np.ndarray:
    """fp8 per-layer scales as float64 (k then v; MLA: one set); empty for other dtypes."""
    if not pool.fp8:
        return np.zeros(0, np.float64)
    sets = [pool.k_scale] if pool.mla else [pool.k_scale, pool.v_scale]
    return torch.cat([s.detach().float().cpu() for s in sets]).double().numpy()


class _Link:
    """Point-to-point messages with one peer, each bounded by the timeout."""

    def __init__(self, peer: int, group: Any, device: torch.device, timeout_s: float) -> None:
        self.peer, self.group, self.device, self.timeout_s = peer, group, device, timeout_s
        self.messages = 0

    def send(self, t: torch.Tensor, what: str) -> Any:
        self.messages += 1
        try:
            return dist.isend(t, self.peer, group=self.group, tag=TAG)
        except RuntimeError as e:
            raise TransferError(f"sending {what} to rank {self.peer} failed: {str(e)[:300]}") from e

    def post_recv(self, t: torch.Tensor, what: str) -> Any:
        self.messages += 1
        try:
            return dist.irecv(t, self.peer, group=self.group, tag=TAG)
        except RuntimeError as e:
            raise TransferError(f"receiving {what} from rank {self.peer} failed: {str(e)[:300]}") from e

    def wait(self, work: Any, what: str) -> None:
        wait(work, self.timeout_s, what, self.peer)

    def send_ints(self, values: Any, what: str) -> None:
        self.wait(self.send(torch.as_tensor(np.asarray(values, np.int64)).to(self.device), what), what)

    def recv_ints(self, n: int, what: str) -> np.ndarray:
        t = torch.empty(n, dtype=torch.int64, device=self.device)
        self.wait(self.post_recv(t, what), what)
        return t.cpu().numpy()


_STAGING: "weakref.WeakKeyDictionary[Any, list[torch.Tensor]]" = weakref.WeakKeyDictionary()


def _staging(link: _Link, pool: Any, per_chunk: int) -> list[torch.Tensor]:
    """Two staging buffers (one being sent while the other is packed), kept per pool so
    repeated transfers do not pay for fresh allocations and page faults."""
    caches = 1 if pool.mla else 2
    n = caches * pool.num_layers * per_chunk * page_bytes(pool)
    owner = getattr(pool, "inner", pool)
    bufs = _STAGING.get(owner)
    if bufs is None or bufs[0].numel() < n or bufs[0].device != link.device:
        with persistent():
            bufs = [torch.empty(n, dtype=torch.uint8, device=link.device) for _ in range(2)]
        _STAGING[owner] = bufs
    return bufs


#: Above this many contiguous page runs per request, pages are packed with one
#: index op per cache kind instead of one copy per run.
MAX_RUNS = 32


def _pack(views: list[torch.Tensor], chunk: torch.Tensor, pages: np.ndarray, idx: torch.Tensor) -> None:
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


def _unpack(views: list[torch.Tensor], chunk: torch.Tensor, pages: np.ndarray, idx: torch.Tensor) -> None:
    """The inverse of ``_pack``: store ``chunk``'s pages into the caches."""
    starts, lengths = contiguous_runs(pages)
    for c, cache in enumerate(views):
        if len(starts) <= MAX_RUNS:
            off = 0
            for s, n in zip(starts.tolist(), lengths.tolist()):
                cache[:, s : s + n].copy_(chunk[c, :, off : off + n])
                off += n
        else:
            cache.index_copy_(1, idx, chunk[c].to(cache.device))


def _chunk_view(buf: torch.Tensor, pool: Any, k: int) -> torch.Tensor:
    """``[caches, layers, k, page_words]`` at the start of a staging buffer (contiguous)."""
    caches = 1 if pool.mla else 2
    word = word_dtype(page_bytes(pool))
    return buf[: caches * pool.num_layers * k * page_bytes(pool)].view(word).view(caches, pool.num_layers, k, -1)


def _chain_hashes(pool: Any, handle: int) -> tuple[int, np.ndarray]:
    """Prefix hook: ``(n, words)``, the request's n leading full pages of known tokens
    as int64 words ``[2n hash words (hi, lo) | salt | n * page_size token ids]``."""
    fn = getattr(pool, "chain_hashes", None)
    if fn is None:
        return 0, np.zeros(0, np.int64)
    hashes, tokens, salt = fn(handle)
    n = len(hashes) // 2
    if not n:
        return 0, np.zeros(0, np.int64)
    words = np.concatenate([np.asarray(hashes, np.uint64).view(np.int64), np.array([salt], np.int64),
                            np.asarray(tokens, np.int64)])
    return n, words


def _split_chain(words: np.ndarray, n: int, page_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The inverse of ``_chain_hashes``'s packing: ``(hash words uint64, tokens, salt)``."""
    if n == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64), 0
    return words[: 2 * n].view(np.uint64), words[2 * n + 1 :], int(words[2 * n])


def _chain_words(n: int, page_size: int) -> int:
    return 0 if n == 0 else 2 * n + 1 + n * page_size


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
    handle (the destination is told to abort). This pool is never changed.
    """
    t0 = time.perf_counter()
    link = _Link(dst_rank, group, comm_device(group, pool.device), timeout_s)
    header = np.zeros(HEADER_LEN, np.int64)
    header[H_MAGIC], header[H_VERSION] = MAGIC, VERSION
    try:
        length = int(pool.length(handle))
        pages = np.asarray(pool.pages(handle), dtype=np.int64)
        n_chain, chain = _chain_hashes(pool, handle)
    except KVPoolError:
        header[H_ABORT] = 1  # let the receiver fail now instead of at its timeout
        link.send_ints(header, "abort header")
        raise
    scales = _scales(pool)
    per_row = (1 if pool.mla else 2) * pool.num_layers * page_bytes(pool)
    per_chunk = max(1, min(len(pages), chunk_bytes // per_row)) if len(pages) else 1
    for k, v in _shape_fields(pool).items():
        header[k] = v
    header[H_LENGTH], header[H_PAGES], header[H_HASHES] = length, len(pages), n_chain
    header[H_SCALES], header[H_PER_CHUNK] = len(scales), per_chunk
    link.send_ints(header, "header")
    if len(chain) + len(scales):
        link.send_ints(np.concatenate([chain, scales.view(np.int64)]), "chain hashes and scales")
    reply = link.recv_ints(REPLY_LEN, "reply")
    status, cached, free, need = (int(x) for x in reply[:4])
    if status != OK:
        reason = REASONS.get(status, f"status {status}")
        detail = {
            EXHAUSTED: f"it needs {need} free pages for {length} tokens but has {free}",
            TOO_MANY: "every request row of its pool is open",
            CONTEXT: f"{length} tokens exceed its max_context_len {int(reply[4])}",
            INCOMPATIBLE: "its pool has another shape, page size, dtype or head shard (see its error)",
        }.get(status, "")
        raise TransferRejectedError(
            f"rank {dst_rank} refused request {handle:#x} ({reason}): {detail}; nothing was sent and "
            f"both pools are unchanged", reason=reason)
    todo = pages[cached:]
    bufs = _staging(link, pool, per_chunk)
    idx_all = torch.from_numpy(todo).to(pool.device)
    views = cache_pages(pool)
    in_flight: list[Any] = [None, None]
    for i, start in enumerate(range(0, len(todo), per_chunk)):
        k = min(per_chunk, len(todo) - start)
        slot = i % 2
        if in_flight[slot] is not None:
            link.wait(in_flight[slot], "K/V chunk")
        view = _chunk_view(bufs[slot], pool, k)
        _pack(views, view, todo[start : start + k], idx_all[start : start + k])
        in_flight[slot] = link.send(view.reshape(-1), "K/V chunk")
    for w in in_flight:
        if w is not None:
            link.wait(w, "K/V chunk")
    ack = link.recv_ints(2, "ack")
    if int(ack[0]) != OK or int(ack[1]) != len(todo):
        raise TransferError(f"rank {dst_rank} acknowledged {int(ack[1])} of {len(todo)} pages (status {int(ack[0])})")
    moved = len(todo) * per_row
    return TransferStats(int(handle), len(pages), cached, moved, link.messages, time.perf_counter() - t0)


def _incompatible(pool: Any, header: np.ndarray) -> str:
    names = {H_PAGE: "page_size", H_LAYERS: "num_layers", H_HEADS: "num_kv_heads (this rank's shard)",
             H_DIM: "head_dim", H_DTYPE: "dtype", H_CACHES: "MLA-ness", H_PAGE_BYTES: "page bytes",
             H_HEAD_START: "first KV head of the shard"}
    diffs = [f"{names[k]} {int(header[k])} vs {v}" for k, v in _shape_fields(pool).items() if int(header[k]) != v]
    return "; ".join(diffs)


def _prefix_match(pool: Any, chain: tuple[np.ndarray, np.ndarray, int], max_pages: int) -> int:
    """Prefix hook: how many leading pages of the sender's chain this pool already caches
    (verified by their tokens and salt in the core, so a hash alone never matches)."""
    fn = getattr(pool, "match_chain_hashes", None)
    hashes, tokens, salt = chain
    if fn is None or not len(hashes) or not hasattr(pool, "open_with_chain_hashes"):
        return 0
    return max(0, min(int(fn(hashes, tokens, salt)), max_pages, len(hashes) // 2))


def _open(pool: Any, chain: tuple[np.ndarray, np.ndarray, int], cached: int, length: int) -> int:
    """Open the destination request: the cached leading pages shared, the rest fresh.
    With a chain, its tokens become the request's known prompt (so ``cache()`` can
    register the received pages later)."""
    hashes, tokens, salt = chain
    if len(hashes) and hasattr(pool, "open_with_chain_hashes"):
        handle = int(pool.open_with_chain_hashes(hashes, tokens, salt, max_pages=cached))
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
    for a pool of another shape, and ``TransferError`` /
    ``TransferTimeoutError`` when the sender dies, aborts or stays silent for
    ``timeout_s`` (the half-received request is closed again).
    """
    return recv_request_stats(pool, src_rank, group, timeout_s=timeout_s).handle


def recv_request_stats(pool: Any, src_rank: int, group: Any = None, *,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> TransferStats:
    """``recv_request`` returning the full ``TransferStats`` (benchmarks)."""
    t0 = time.perf_counter()
    link = _Link(src_rank, group, comm_device(group, pool.device), timeout_s)
    header = link.recv_ints(HEADER_LEN, "header")
    if int(header[H_MAGIC]) != MAGIC or int(header[H_VERSION]) != VERSION:
        raise TransferError(f"rank {src_rank} sent no kvpool transfer header (magic/version "
                            f"{int(header[H_MAGIC]):#x}/{int(header[H_VERSION])}); is it running send_request?")
    if int(header[H_ABORT]):
        raise TransferError(f"rank {src_rank} aborted the transfer before sending (its handle was invalid)")
    length, n_pages = int(header[H_LENGTH]), int(header[H_PAGES])
    n_hashes, n_scales, per_chunk = int(header[H_HASHES]), int(header[H_SCALES]), int(header[H_PER_CHUNK])
    n_chain = _chain_words(n_hashes, int(header[H_PAGE]))
    meta = link.recv_ints(n_chain + n_scales, "chain hashes and scales") if n_chain + n_scales else np.zeros(0, np.int64)
    chain = _split_chain(meta[:n_chain], n_hashes, int(header[H_PAGE]))
    src_scales = meta[n_chain:].view(np.float64)
    alloc = pool  # the KVPool facade: counters, pages, max_context_len
    P = pool.page_size

    def refuse(status: int, error: Exception, need: int = 0, extra: int = 0) -> Exception:
        link.send_ints([status, 0, int(alloc.free_pages), need, extra, 0], "refusal")
        return error

    diff = _incompatible(pool, header)
    if diff:
        raise refuse(INCOMPATIBLE, TransferRejectedError(
            f"request from rank {src_rank} does not fit this pool's shape ({diff}); both pools need the "
            f"same page size, layers, head shard, head_dim and dtype", reason="incompatible"))
    if length > alloc.max_context_len:
        raise refuse(CONTEXT, ContextTooLongError(
            f"received request of {length} tokens exceeds max_context_len {alloc.max_context_len}"),
            extra=int(alloc.max_context_len))
    cached = _prefix_match(pool, chain, min(n_pages, length // P))
    need = -(-length // P) - cached
    if need > alloc.free_pages:
        raise refuse(EXHAUSTED, PoolExhaustedError(
            f"cannot receive a request of {length} tokens from rank {src_rank}: needs {need} pages "
            f"({need * P} slots) but only {alloc.free_pages} pages ({alloc.free_slots} slots) are free"), need=need)
    try:
        handle = _open(pool, chain, cached, length)
    except PoolExhaustedError as e:
        raise refuse(EXHAUSTED, e, need=need) from None
    except TooManyRequestsError as e:
        raise refuse(TOO_MANY, e) from None
    except ContextTooLongError as e:
        raise refuse(CONTEXT, e, extra=int(alloc.max_context_len)) from None
    try:
        dst_pages = np.asarray(alloc.pages(handle), dtype=np.int64)[cached:]
        link.send_ints([OK, cached, int(alloc.free_pages), need, 0, 0], "reply")
        _receive_pages(link, pool, dst_pages, per_chunk, src_scales)
        link.send_ints([OK, len(dst_pages)], "ack")
    except BaseException:
        pool.close([handle])
        raise
    moved = len(dst_pages) * (1 if pool.mla else 2) * pool.num_layers * page_bytes(pool)
    return TransferStats(handle, n_pages, cached, moved, link.messages, time.perf_counter() - t0)


def _rescale(pool: Any, view: torch.Tensor, src_scales: np.ndarray) -> None:
    """fp8: re-quantize rows stored with the sender's scales to this pool's scales, in place."""
    if not len(src_scales):
        return
    mine = _scales(pool)
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


def _receive_pages(link: _Link, pool: Any, dst_pages: np.ndarray, per_chunk: int, src_scales: np.ndarray) -> None:
    if not len(dst_pages):
        return
    if pool.fp8 and pool.dtype not in FP8_DTYPES:  # pragma: no cover - FP8_DTYPES defines fp8
        raise TransferError(f"unknown fp8 dtype {pool.dtype}")
    bufs = _staging(link, pool, per_chunk)
    idx_all = torch.from_numpy(dst_pages).to(pool.device)
    views = cache_pages(pool)
    starts = list(range(0, len(dst_pages), per_chunk))
    sizes = [min(per_chunk, len(dst_pages) - s) for s in starts]
    pending = link.post_recv(_chunk_view(bufs[0], pool, sizes[0]).view(-1), "K/V chunk")
    for i, (start, k) in enumerate(zip(starts, sizes)):
        link.wait(pending, "K/V chunk")
        view = _chunk_view(bufs[i % 2], pool, k)
        if i + 1 < len(starts):  # the next chunk lands in the other buffer while this one is stored
            pending = link.post_recv(_chunk_view(bufs[(i + 1) % 2], pool, sizes[i + 1]).view(-1), "K/V chunk")
        _rescale(pool, view, src_scales)
        _unpack(views, view, dst_pages[start : start + k], idx_all[start : start + k])
