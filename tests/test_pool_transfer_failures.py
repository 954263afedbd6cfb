"""A host-tier transfer that fails (a CUDA OOM or launch error; injected here) after the
core queued it: the core already counts the transfer's pages as holding the entries
they were to receive, so the pool drops every prefix-cache entry before it raises. A
later prompt then misses (and is computed again); it never hits pages whose bytes
never arrived. A call that opened requests closes them again."""

from __future__ import annotations

import pytest
import torch

import kvpool
from kvpool.tiers.transfers import TransferRunner

PROMPT = [1, 2, 3, 4, 5]


def cached_pool() -> tuple[kvpool.KVPool, torch.Tensor]:
    """Two cached device pages of PROMPT (page size 2), and room for two more."""
    pool = kvpool.KVPool(1, 1, 2, dtype=torch.float32, page_size=2, num_pages=4, max_requests=4,
                         max_context_len=16, host_pages=4, hash_seed=1)
    h, r = pool.admit([5], tokens=PROMPT)
    k = torch.arange(1, 6, dtype=torch.float32).view(5, 1, 1).expand(5, 1, 2).contiguous()
    pool.write(0, r.slots, k, -k)
    pool.close(h, cache=True)
    return pool, k


def fail_transfers(monkeypatch):
    def failing(self, *args, **kwargs):
        raise RuntimeError("CUDA error: out of memory (injected)")

    monkeypatch.setattr(TransferRunner, "run", failing)


def assert_hits_are_true(pool: kvpool.KVPool, k: torch.Tensor) -> None:
    h, cached = pool.open_with_prefix(PROMPT, [5])
    n = int(cached[0])
    got_k, got_v = pool.read(0, pool.slots(int(h[0]))[:n])
    assert torch.equal(got_k, k[:n]) and torch.equal(got_v, -k[:n])
    pool.close(h)
    pool.check()


def test_failed_offloads_leave_no_host_entry_without_its_bytes(monkeypatch):
    pool, k = cached_pool()
    fail_transfers(monkeypatch)
    with pytest.raises(RuntimeError, match="injected"):
        pool.evict(2)  # write_back: the two pages' offloads fail
    monkeypatch.undo()
    pool.check()
    assert pool.host_cached_pages == 0 and pool.cached_pages == 0
    assert_hits_are_true(pool, k)


def test_failed_host_hit_loads_close_the_requests_they_opened(monkeypatch):
    pool, k = cached_pool()
    pool.evict(2)  # both pages now live on the host only
    assert pool.host_cached_pages == 2
    opened, counted = pool.open_requests, hit_counters(pool)
    fail_transfers(monkeypatch)
    with pytest.raises(RuntimeError, match="injected"):
        pool.open_with_prefix(PROMPT, [5])  # host hits: their loads fail
    monkeypatch.undo()
    pool.check()
    assert pool.open_requests == opened  # no request the caller never got a handle for
    assert hit_counters(pool) == counted  # and no prompt served: the hit rate does not count it
    assert pool.cached_pages == 0 and pool.host_cached_pages == 0
    assert_hits_are_true(pool, k)


def hit_counters(pool: kvpool.KVPool) -> tuple[int, int, int]:
    stats = pool.stats()
    return stats.hit_tokens, stats.miss_tokens, stats.host_hit_tokens

