"""Retention priorities through KVPool, as an engine uses them: a pinned system
prompt survives pressure that evicts everything else, low-priority pages go
before the default ones, pins are never counted free (and PoolExhaustedError
says so), unpin and clear_cache give the pages back, and durations end on the
pool's manual clock."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool

P = 4
SYSTEM = np.arange(1000, 1016)  # 4 full pages


def make_pool(**kw) -> kvpool.KVPool:
    return kvpool.KVPool(1, 1, 4, dtype=torch.float32, num_pages=17, page_size=P, max_requests=4,
                         max_context_len=64, manual_clock=True, **kw)


def serve(pool: kvpool.KVPool, prompt: np.ndarray, **close_kw) -> int:
    """One request on `prompt`: prefix hit, prefill, close with caching; returns the hit length."""
    h, c = pool.open_with_prefix(prompt, [len(prompt)])
    pool.extend(h, len(prompt) - int(c[0]))
    pool.close(h, cache=True, **close_kw)
    pool.check()
    return int(c[0])


def test_a_pinned_system_prompt_survives_pressure_that_evicts_the_rest():
    pool = make_pool()
    serve(pool, np.concatenate([SYSTEM, [1]]), priority=100)
    assert pool.pinned_pages == 4 == pool.max_pinned_pages
    for i in range(8):  # 16 full pages of other prompts through a pool of 12 unpinned pages
        serve(pool, np.arange(100 * i, 100 * i + 8))
    assert pool.pinned_pages == 4
    assert serve(pool, np.concatenate([SYSTEM, [2]])) == 16, "the pinned prefix still hits"
    assert serve(pool, np.arange(0, 9)) == 0, "the oldest unpinned prompt was evicted"


def test_low_priority_pages_go_before_default_ones():
    pool = make_pool()
    serve(pool, np.arange(0, 9), priority=np.array([0]))  # per request: a numpy array
    serve(pool, np.arange(100, 109))
    assert pool.evictable_pages_by_priority()[[0, kvpool.DEFAULT_PRIORITY]].tolist() == [2, 2]
    assert pool.evict(2) == 2
    assert serve(pool, np.arange(100, 109)) == 8, "the default-priority prompt stayed"
    assert serve(pool, np.arange(0, 9)) == 0


def test_pinned_pages_are_not_free_and_the_exhausted_error_says_so():
    pool = make_pool(max_pinned_pages=8)
    serve(pool, np.concatenate([np.arange(500, 532), [1]]), priority=100)  # 8 pinned pages
    assert (pool.free_pages, pool.used_pages, pool.admissible_tokens) == (8, 0, 8 * P)
    h = pool.open(1)
    table = pool.req_to_token.clone()
    with pytest.raises(kvpool.PoolExhaustedError, match="pinned cached pages are not free"):
        pool.extend(h, 9 * P)
    assert torch.equal(pool.req_to_token, table) and pool.length(int(h[0])) == 0
    pool.close(h)
    # Reached through a request opened on the prefix, the pins come back.
    g, c = pool.open_with_prefix(np.concatenate([np.arange(500, 532), [7]]), [33])
    assert int(c[0]) == 32
    assert pool.unpin(g) == 8
    pool.close(g)
    assert (pool.pinned_pages, pool.free_pages) == (0, 16)
    pool.check()


def test_clear_cache_unpins_and_durations_end_on_the_clock():
    pool = make_pool()
    serve(pool, np.arange(0, 9), priority=90, retain_s=2.0)
    serve(pool, np.arange(100, 109), priority=100)
    assert pool.evictable_pages_by_priority()[90] == 2 and pool.pinned_pages == 2
    pool.set_clock(2.0)
    assert pool.evictable_pages_by_priority()[90] == 0
    assert pool.clock == 2.0
    pool.clear_cache()
    assert (pool.pinned_pages, pool.cached_pages, pool.free_pages) == (0, 0, 16)
    with pytest.raises(kvpool.InvalidArgumentError):
        kvpool.KVPool(1, 1, 4, num_pages=17).set_clock(1.0)  # the system clock
