"""Per-rank bodies of the hostile-peer transfer tests (spawned by tests/_dist.py).

Rank 0 plays a broken or hostile sender: it writes transfer headers by hand, one
field wrong at a time, and times how long the receiver takes to refuse. Rank 1
runs the real ``recv_request`` and reports each error, how long it took and
whether its pool and its staging stayed as they were.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import kvpool
from kvpool.distributed import TransferRejectedError, chunks, kv_transfer
from kvpool.distributed import protocol as P

PAGE, PAGES, MAX_CTX = 4, 40, 80
LENGTH = 13  # 4 pages, the last one partly filled
PEER_TIMEOUT_S = 10.0


def make_pool(**kw: Any) -> kvpool.KVPool:
    kw.setdefault("dtype", torch.float32)
    return kvpool.KVPool(2, 2, 8, page_size=PAGE, num_pages=PAGES, max_requests=4, max_context_len=MAX_CTX, **kw)


def snapshot(pool: Any) -> tuple:
    pool.check()
    return (pool.free_pages, pool.used_pages, pool.open_requests, pool.used_slots, pool.cached_pages,
            pool.req_to_token.clone().numpy().tobytes())


def good_header(pool: Any) -> np.ndarray:
    """What ``send_request`` writes for a LENGTH-token request without chain hashes."""
    h = np.zeros(P.HEADER_LEN, np.int64)
    h[P.H_MAGIC], h[P.H_VERSION] = P.MAGIC, P.VERSION
    for k, v in P.shape_fields(pool).items():
        h[k] = v
    h[P.H_LENGTH], h[P.H_PAGES], h[P.H_PER_CHUNK] = LENGTH, -(-LENGTH // PAGE), 2
    h[P.H_SCALES] = P.num_scales(pool)
    return h


def _chain_meta(bad_token: bool) -> np.ndarray:
    """One chain page (2 hash words, the salt, PAGE token ids) for a header with 1 hash."""
    tokens = [5, 6, 7, -3 if bad_token else 8]
    return np.array([123, 456, 0] + tokens, np.int64)


# name -> (fields to change, metadata the sender sends, expected status, expected receiver error)
CASES: dict[str, tuple[dict[int, int], Any, int, str]] = {
    "per_chunk_0": ({P.H_PER_CHUNK: 0}, None, P.MALFORMED, "pages per chunk"),
    "per_chunk_-3": ({P.H_PER_CHUNK: -3}, None, P.MALFORMED, "pages per chunk"),
    "per_chunk_2**24": ({P.H_PER_CHUNK: 2**24}, None, P.MALFORMED, "pages per chunk"),
    "n_hashes_-1": ({P.H_HASHES: -1}, None, P.MALFORMED, "negative counts"),
    "n_scales_-1": ({P.H_SCALES: -1}, None, P.MALFORMED, "negative counts"),
    "n_hashes_2**40": ({P.H_HASHES: 2**40}, None, P.MALFORMED, "more than this pool could ever be sent"),
    "n_scales_2**27": ({P.H_SCALES: 2**27}, None, P.MALFORMED, "more than this pool could ever be sent"),
    "n_hashes_past_length": ({P.H_HASHES: 4}, np.zeros(2 * 4 + 1 + 4 * PAGE, np.int64), P.MALFORMED,
                             "chain hashes for 13 tokens"),
    "n_scales_on_a_float32_pool": ({P.H_SCALES: 3}, np.zeros(3, np.int64), P.MALFORMED, "fp8 scales"),
    "length_-40": ({P.H_LENGTH: -40}, None, P.MALFORMED, "-40 tokens"),
    "length_past_max_context_len": ({P.H_LENGTH: MAX_CTX + 1, P.H_PAGES: -(-(MAX_CTX + 1) // PAGE)}, None,
                                    P.CONTEXT, "exceeds max_context_len"),
    "pages_2**40": ({P.H_PAGES: 2**40}, None, P.MALFORMED, "pages for 13 tokens"),
    "pages_0": ({P.H_PAGES: 0}, None, P.MALFORMED, "pages for 13 tokens"),
    "page_size_0": ({P.H_PAGE: 0}, None, P.MALFORMED, "page size 0"),
    "version_99": ({P.H_VERSION: 99}, None, P.MALFORMED, "protocol version 99"),
    "dtype": ({P.H_DTYPE: P.dtype_code(torch.float16)}, None, P.INCOMPATIBLE, "dtype"),
    "page_bytes": ({P.H_PAGE_BYTES: 7}, None, P.INCOMPATIBLE, "page bytes"),
    "page_size_8": ({P.H_PAGE: 8}, None, P.INCOMPATIBLE, "page_size"),
    "bad_chain_token": ({P.H_HASHES: 1}, _chain_meta(bad_token=True), P.MALFORMED, "not a token id"),
    "salt_unlike_the_chain_s": ({P.H_HASHES: 1, P.H_SALT: 9}, _chain_meta(bad_token=False), P.MALFORMED,
                                "salt 9 in the header but 0 in the chain"),
}


def hostile_sender(rank: int, world: int) -> dict[str, Any]:
    pool = make_pool()
    fp8 = make_pool(dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    link = kv_transfer._Link(1, None, torch.device("cpu"), PEER_TIMEOUT_S)
    out: dict[str, Any] = {}
    for name, (fields, meta, _status, _text) in CASES.items():
        header = good_header(pool)
        for k, v in fields.items():
            header[k] = v
        dist.barrier()
        t0 = time.monotonic()
        link.send_ints(header, "header")
        if meta is not None:
            link.send_ints(meta, "meta")
        reply = link.recv_ints(P.REPLY_LEN, "reply")
        out[name] = (int(reply[0]), time.monotonic() - t0)
    # fp8: scales that are not finite and positive.
    for name, bad in (("fp8_scale_nan", np.nan), ("fp8_scale_0", 0.0)):
        header = good_header(fp8)
        scales = np.ones(P.num_scales(fp8), np.float64)
        scales[1] = bad
        dist.barrier()
        t0 = time.monotonic()
        link.send_ints(header, "header")
        link.send_ints(scales.view(np.int64), "scales")
        reply = link.recv_ints(P.REPLY_LEN, "reply")
        out[name] = (int(reply[0]), time.monotonic() - t0)
    # The real send_request of a sender speaking another version is refused at once.
    h = int(pool.open(1)[0])
    pool.extend([h], LENGTH)
    dist.barrier()
    kv_transfer.VERSION = 99
    t0 = time.monotonic()
    try:
        kv_transfer.send_request(pool, h, 1, timeout_s=PEER_TIMEOUT_S)
        out["real_sender_refused"] = None
    except TransferRejectedError as e:
        out["real_sender_refused"] = (e.reason, str(e), time.monotonic() - t0)
    kv_transfer.VERSION = P.VERSION
    # After all of that the channel still works: a real transfer, then one with staging
    # above what is kept.
    for _ in range(2):
        g = torch.Generator().manual_seed(3)
        for layer in range(pool.num_layers):
            x = torch.randn(LENGTH, 2, 8, generator=g)
            pool.write(layer, pool.slots(h), x, -x)
        dist.barrier()
        kv_transfer.send_request(pool, h, 1, timeout_s=PEER_TIMEOUT_S, chunk_bytes=1)
    out["sent"] = [pool.read(layer, pool.slots(h)) for layer in range(pool.num_layers)]
    return out


def hostile_receiver(rank: int, world: int) -> dict[str, Any]:
    pool = make_pool()
    fp8 = make_pool(dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    pool.extend(pool.open(1), 9)  # something held, so "unchanged" means more than empty
    out: dict[str, Any] = {}
    for name in list(CASES) + ["fp8_scale_nan", "fp8_scale_0"]:
        target = fp8 if name.startswith("fp8") else pool
        before = snapshot(target)
        dist.barrier()
        t0 = time.monotonic()
        try:
            kv_transfer.recv_request(target, 0, timeout_s=PEER_TIMEOUT_S)
            out[name] = None
        except kvpool.KVPoolError as e:
            out[name] = {"error": type(e).__name__, "reason": getattr(e, "reason", ""), "message": str(e),
                         "seconds": time.monotonic() - t0, "unchanged": snapshot(target) == before,
                         "staging": chunks.STAGING.get(target) is not None}
    before = snapshot(pool)
    dist.barrier()
    try:
        kv_transfer.recv_request(pool, 0, timeout_s=PEER_TIMEOUT_S)
        out["real_sender_refused"] = None
    except TransferRejectedError as e:
        out["real_sender_refused"] = (e.reason, snapshot(pool) == before)
    got, kept = [], []
    for keep in (chunks.KEEP_STAGING_BYTES, 0):
        chunks.KEEP_STAGING_BYTES = keep
        dist.barrier()
        h = kv_transfer.recv_request(pool, 0, timeout_s=PEER_TIMEOUT_S)
        got.append([pool.read(layer, pool.slots(h)) for layer in range(pool.num_layers)])
        kept.append(chunks.STAGING.get(pool) is not None)
        pool.close([h])
        chunks.STAGING.pop(pool, None)
    pool.check()
    out["received"], out["staging_kept"] = got, kept
    return out


def hostile(rank: int, world: int) -> dict[str, Any]:
    return hostile_sender(rank, world) if rank == 0 else hostile_receiver(rank, world)
