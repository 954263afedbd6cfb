"""The receiving pool of tests/test_chain_open_length.py and its two-rank transfer body
(spawned by tests/_dist.py; importable by name).

The receiver has 4 pages of room and no FREE page: prompt A's two cached pages (the
oldest) and prompt B's two. A request whose chain matches A's pages and needs 3 more
pages passes a ``free_pages`` check (3 <= 4), but once A's pages are held only B's 2
are left.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import kvpool
from kvpool.distributed import TransferRejectedError, kv_transfer

P = 4
SEED = 1234
PROMPT_A = np.arange(100, 108)
PROMPT_B = np.arange(200, 208)
REST = np.arange(300, 312)


def make_pool() -> kvpool.KVPool:
    return kvpool.KVPool(1, 1, 8, page_size=P, num_pages=8, max_requests=4, max_context_len=64,
                         dtype=torch.float32, hash_seed=SEED)


def serve(pool: kvpool.KVPool, prompt: np.ndarray) -> None:
    hs, cl = pool.open_with_prefix(prompt, [len(prompt)])
    pool.extend(hs, len(prompt) - int(cl[0]))
    pool.close(hs, cache=True)


def receiver() -> kvpool.KVPool:
    pool = make_pool()
    serve(pool, PROMPT_A)
    serve(pool, PROMPT_B)
    h = pool.open(1)
    pool.extend(h, 3 * P)  # the 3 FREE pages
    assert (pool.free_pages, pool.allocator.evictable_pages) == (4, 4)
    return pool


def chain(n_tokens: int = 20) -> tuple[np.ndarray, np.ndarray, int]:
    """The chain another pool (same hash seed) sends for A + REST (5 full pages)."""
    src = make_pool()
    prompt = np.concatenate([PROMPT_A, REST])[:n_tokens]
    hs, _ = src.open_with_prefix(prompt, [len(prompt)])
    src.extend(hs, len(prompt))
    hashes, tokens, salt = src.chain_hashes(int(hs[0]))
    return hashes, tokens, int(salt)


def fields(stats: object) -> dict[str, object]:
    return {k: getattr(stats, k) for k in dir(stats) if not k.startswith("_") and not callable(getattr(stats, k))}


def assert_as_never_called(pool: kvpool.KVPool) -> None:
    """Same counters as a pool that never saw the call, and the same victims next."""
    twin = receiver()
    pool.check()
    assert fields(pool.allocator.stats()) == fields(twin.allocator.stats())
    assert pool.allocator.evictable_pages == twin.allocator.evictable_pages
    got, want = pool.open(1), twin.open(1)
    np.testing.assert_array_equal(pool.extend(got, 4 * P).slots, twin.extend(want, 4 * P).slots)


def transfer(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 sends A + REST (20 tokens: refused), then A + REST[:8] (16: fits exactly)."""
    out: dict[str, Any] = {}
    if rank == 0:
        src = make_pool()
        for n in (20, 16):
            prompt = np.concatenate([PROMPT_A, REST])[:n]
            hs, _ = src.open_with_prefix(prompt, [n])
            src.extend(hs, n)
            h = int(hs[0])
            x = torch.randn(n, 1, 8, generator=torch.Generator().manual_seed(n))
            src.write(0, src.slots(h), x, -x)
            try:
                st = kv_transfer.send_request(src, h, 1, timeout_s=30)
                out[n] = (st.pages, st.cached_pages)
            except TransferRejectedError as e:
                out[n] = e.reason
            out[(n, "kv")] = src.read(0, src.slots(h)[8:])
            src.close(hs)
        return out
    refused = receiver()
    try:
        kv_transfer.recv_request(refused, 0, timeout_s=30)
        out[20] = None
    except kvpool.PoolExhaustedError as e:
        out[20] = str(e)
    assert_as_never_called(refused)  # raises in this rank (the test fails) if it changed
    pool = receiver()
    h = kv_transfer.recv_request(pool, 0, timeout_s=30)
    out[16] = (int(pool.length(h)), int(pool.free_pages))
    out[(16, "kv")] = pool.read(0, pool.slots(h)[8:])
    pool.check()
    return out
