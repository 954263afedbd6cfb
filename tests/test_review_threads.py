"""Outside review of KVPool under threads (rev45): targeted repros of what a
randomized multi-thread hunt and a read of the locks turned up.

Whether ``extend`` asks the core for copy-on-write work is decided by the pool's
``_sharing`` flag, under the pool's lock, set by every call that can leave a page
with two holders. ``swap_in`` is one: a swapped-out request's registered page
whose entry another request's duplicate registration took over comes back as
that request's page (``SlotAllocator.swap_in``), so both hold it.
"""

from __future__ import annotations

import numpy as np
import torch

import kvpool

P = 4


def _pool(**kw) -> kvpool.KVPool:
    kw = {"dtype": torch.float32, "page_size": P, "num_pages": 16, "host_pages": 16, "max_requests": 8,
          "max_context_len": 32, **kw}
    return kvpool.KVPool(1, 1, 1, **kw)


def _write(pool, result, values) -> None:
    t = torch.tensor(values, dtype=torch.float32).view(-1, 1, 1)
    pool.write(0, result.out_cache_loc, t, -t)


def _values(pool, h) -> list[float]:
    k, v = pool.read(0, pool.slots(int(h)))
    assert torch.equal(v, -k)
    return k.flatten().tolist()


def _share_by_swap_in(pool):
    """A and B hold the same two full pages of the same tokens: A was swapped out,
    B registered those tokens meanwhile, A came back on B's pages."""
    toks = list(range(10, 18))
    a, ra = pool.admit([8], tokens=toks)
    _write(pool, ra, [1.0] * 8)
    pool.cache(a)
    pool.swap_out(a)
    b, rb = pool.admit([8], tokens=toks)
    _write(pool, rb, [2.0] * 8)
    pool.cache(b)
    pool.swap_in(a)
    return int(a[0]), int(b[0])


def test_a_request_swapped_in_onto_shared_pages_copies_on_write():
    pool = _pool()
    a, b = _share_by_swap_in(pool)
    assert np.array_equal(pool.pages(a), pool.pages(b)), "the scenario no longer shares pages"
    pool.truncate([a], [6])
    r = pool.extend(np.array([a], dtype=np.int64), 2)  # into the shared last page: a copy first
    _write(pool, r, [3.0, 3.0])
    assert _values(pool, b) == [2.0] * 8
    assert _values(pool, a) == [2.0] * 6 + [3.0, 3.0]
    assert pool.allocator.pending_copies == 0
    pool.check()

