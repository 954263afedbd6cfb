"""DiskCache over a pool with a host tier: Stored events now name a tier, and only a
device page is read for the disk, once per hash; pages that moved to the host (and
back) are not written twice; a prefix that lives only on the pool's host tier still
comes back bitwise, from the host or from the disk; and a new tiered pool gets the
disk's prefixes bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_tier_disk_cache import LAYERS, TOKENS, P, hit, make_pool, prefill

from kvpool.tiers import DiskCache, FileTier


def tiered(num_pages=8, host_pages=32, policy="write_back", **kw):
    return make_pool(num_pages=num_pages, host_pages=host_pages, host_policy=policy, **kw)


def flood(pool, base):
    """Take, write and release every device page: cached device pages are evicted
    (write_back: offloaded to the host)."""
    toks = np.arange(base, base + pool.free_pages * P - 1, dtype=np.int32)
    h, _ = pool.open_with_prefix(toks, [len(toks)])
    slots = pool.extend(h, [len(toks)]).slots
    for layer in range(LAYERS):
        x = torch.full((len(slots), pool.num_kv_heads, pool.head_dim), 3.0, dtype=pool.compute_dtype)
        pool.write(layer, slots, x, x)
    pool.close(h)


def test_host_moves_do_not_store_twice_and_a_new_pool_gets_the_prefix(tmp_path):
    for policy in ("write_back", "write_through"):
        src = tiered(policy=policy, hash_seed=11)
        tier = FileTier(tmp_path / policy, 1 << 20)
        dc = DiskCache(src, tier, model="m")
        want = prefill(src, TOKENS, seed=1)
        assert dc.store_new() == 4
        flood(src, 5000)  # the prefix leaves the device; its host copies stay
        assert src.cached_pages == 0 and src.host_cached_pages >= 4
        assert dc.store_new() == 0, "host Stored events are not pages to store"
        n, got = hit(src, TOKENS)  # back from the host: Stored on the device again
        assert n == 16 and torch.equal(got, want[:, :16])
        assert dc.store_new() == 0 and dc.stats.pages_stored == 4, "already on disk"
        dst = tiered(hash_seed=22, policy=policy)
        dd = DiskCache(dst, tier, model="m")
        assert dd.prefetch(TOKENS) == 4
        n, got = hit(dst, TOKENS)
        assert n == 16 and torch.equal(got, want[:, :16])
        src.check()
        dst.check()


def test_a_prefix_only_on_the_host_tier_is_not_read_from_stale_device_pages(tmp_path):
    """Registered and evicted to the host before store_new ran: no device page holds it
    any more, so nothing is written from the device (a later hit, loaded back, is)."""
    src = tiered(hash_seed=11)
    tier = FileTier(tmp_path, 1 << 20)
    dc = DiskCache(src, tier, model="m")
    want = prefill(src, TOKENS, seed=1)
    flood(src, 5000)
    assert src.cached_pages == 0
    assert dc.store_new() == 0
    n, got = hit(src, TOKENS)
    assert n == 16 and torch.equal(got, want[:, :16])
    assert dc.store_new() == 4
    dst = tiered(hash_seed=22)
    assert DiskCache(dst, tier, model="m").prefetch(TOKENS) == 4
    n, got = hit(dst, TOKENS)
    assert n == 16 and torch.equal(got, want[:, :16])


def test_prefetch_into_a_pool_that_has_the_prefix_on_its_host_tier(tmp_path):
    """The disk and the pool's host tier both hold the prefix: prefetch loads it onto the
    device, and a hit then reads it bitwise (no page registered twice: check())."""
    src = tiered(hash_seed=11)
    tier = FileTier(tmp_path, 1 << 20)
    dc = DiskCache(src, tier, model="m")
    want = prefill(src, TOKENS, seed=1)
    assert dc.store_new() == 4
    flood(src, 5000)
    dc.prefetch(TOKENS)
    src.check()
    n, got = hit(src, TOKENS)
    assert n == 16 and torch.equal(got, want[:, :16])
    src.check()


def test_a_failed_write_through_offload_in_prefetch_raises_that_failure(tmp_path, monkeypatch):
    """prefetch publishes its loaded pages with close(cache=True); under write_through that
    queues offloads, and if running them fails, the close has already closed the scratch
    request (and the pool cleared its cache, as for any failed transfer). Its cleanup
    closed the request a second time, so the caller got an InvalidHandleError about a
    handle it never had instead of the device error."""
    src = tiered(hash_seed=11, policy="write_through")
    tier = FileTier(tmp_path, 1 << 20)
    dc = DiskCache(src, tier, model="m")
    prefill(src, TOKENS, seed=1)
    assert dc.store_new() == 4
    dst = tiered(hash_seed=22, policy="write_through")
    dd = DiskCache(dst, tier, model="m")

    def fail(*args, **kwargs):
        raise RuntimeError("device copy failed")

    monkeypatch.setattr(dst._transfers, "run", fail)
    with pytest.raises(RuntimeError, match="device copy failed"):
        dd.prefetch(TOKENS)
    assert dst.open_requests == 0, "the scratch request is closed"
    ev = dst.take_events()
    assert ev["kind"].tolist()[-1] == 2, "the failed transfer cleared the cache (Cleared is the last event)"
    assert dst.cached_pages == 0 and dst.host_cached_pages == 0
    dst.check()
