"""An outside sweep of the monitoring surface: the prefix-cache counters a scrape
reads while another thread's call is half done (an open the pool undoes after the
core counted its prompt). The retention half is test_review_retention_order.py."""

from __future__ import annotations

import threading

import pytest
import torch

import kvpool
from kvpool.tiers.transfers import TransferRunner

prometheus_client = pytest.importorskip("prometheus_client", reason="the metrics extra is not installed")

from kvpool.metrics import KVPoolCollector  # noqa: E402

COUNTERS = ("kvpool_prefix_cache_hits_total", "kvpool_prefix_cache_queries_total")


def counters(reg) -> dict[str, float]:
    return {n: reg.get_sample_value(n, {"pool": "p"}) for n in COUNTERS}


def scrape_from_another_thread(reg, seen: list) -> threading.Thread:
    """A Prometheus scrape (its HTTP thread) while this thread is inside a pool call: it
    runs now, or, if the pool's lock keeps it out, once the call is over. Either way
    what it reads must never exceed what a later scrape reads."""
    t = threading.Thread(target=lambda: seen.append(counters(reg)))
    t.start()
    t.join(0.5)  # long enough that a scrape the pool's lock does not keep out has run
    return t


def assert_never_went_back(reg, before, seen, thread) -> None:
    thread.join()
    after = counters(reg)
    assert after == before  # the failed open is not counted
    assert seen and all(seen[0][n] <= after[n] for n in COUNTERS), (before, seen, after)


def test_a_scrape_during_a_failed_host_hit_open_never_sees_the_hits_taken_back(monkeypatch):
    """Was: KVPool.stats() read the allocator without the pool's lock, so a scrape while
    a host hit's load failed read the prompt's hits before the pool took them back
    (kvpool_prefix_cache_hits_total went 0 -> 4 -> 0: a counter going down)."""
    pool = kvpool.KVPool(1, 1, 2, dtype=torch.float32, page_size=2, num_pages=4, max_requests=4,
                         max_context_len=16, host_pages=4, hash_seed=1)
    h, _ = pool.admit([5], tokens=[1, 2, 3, 4, 5])
    pool.close(h, cache=True)
    pool.evict(2)  # both pages on the host only: the next open's hit loads them back
    reg = prometheus_client.CollectorRegistry()
    reg.register(KVPoolCollector({"p": pool}))
    before, seen, box = counters(reg), [], []

    def failing(self, *args, **kwargs):
        box.append(scrape_from_another_thread(reg, seen))
        raise RuntimeError("CUDA error: out of memory (injected)")

    monkeypatch.setattr(TransferRunner, "run", failing)
    with pytest.raises(RuntimeError, match="injected"):
        pool.open_with_prefix([1, 2, 3, 4, 5], [5])
    monkeypatch.undo()
    assert_never_went_back(reg, before, seen, box[0])
    pool.check()


def test_a_scrape_during_a_failed_hybrid_open_never_sees_the_hits_taken_back(monkeypatch):
    """The same for a hybrid pool: the collector read its GroupedAllocator directly."""
    pool = kvpool.KVPool(2, 1, 4, layer_types=["full_attention", "sliding_attention"], sliding_window=4,
                         dtype=torch.float32, page_size=2, num_pages=16, max_requests=4, max_context_len=32,
                         hash_seed=1)
    prompt = list(range(100, 109))
    h, _ = pool.admit([9], tokens=prompt)
    pool.close(h, cache=True)
    reg = prometheus_client.CollectorRegistry()
    reg.register(KVPoolCollector({"p": pool}))
    before, seen, box = counters(reg), [], []

    def failing(handles):
        box.append(scrape_from_another_thread(reg, seen))
        raise RuntimeError("CUDA error: out of memory (injected)")

    monkeypatch.setattr(pool, "_fill_new_rows", failing)
    with pytest.raises(RuntimeError, match="injected"):
        pool.open_with_prefix(prompt, [9])
    monkeypatch.undo()
    assert_never_went_back(reg, before, seen, box[0])
    assert seen[0]["kvpool_prefix_cache_hits_total"] == 0
    pool.check()


def test_a_scrape_during_a_disk_cache_store_never_counts_its_scratch_requests(tmp_path, monkeypatch):
    """Was: DiskCache.store_new opened a scratch request on each chain (which counts its
    prompt as a hit) and took the count back in a second call, outside the pool's lock: a
    scrape in between read hits that no prompt had, and the counter then went back."""
    from kvpool.tiers import DiskCache, FileTier

    pool = kvpool.KVPool(1, 1, 2, dtype=torch.float32, page_size=2, num_pages=16, max_requests=4,
                         max_context_len=32, hash_seed=1)
    h, _ = pool.admit([9], tokens=list(range(9)))
    pool.close(h, cache=True)
    dc = DiskCache(pool, FileTier(tmp_path, 1 << 20), model="m")
    reg = prometheus_client.CollectorRegistry()
    reg.register(KVPoolCollector({"p": pool}))
    before, seen, box = counters(reg), [], []
    length = pool.length

    def length_then_scrape(handle):
        if not box:
            box.append(scrape_from_another_thread(reg, seen))
        return length(handle)

    monkeypatch.setattr(pool, "length", length_then_scrape)
    assert dc.store_new() == 4
    monkeypatch.undo()
    assert box, "store_new opened a scratch request"
    assert_never_went_back(reg, before, seen, box[0])
    pool.check()


@pytest.mark.parametrize("hybrid", [False, True])
def test_stats_waits_for_a_call_in_flight_only_so_long(monkeypatch, hybrid):
    """A request transfer holds the pool's lock for its whole length (up to its timeout_s):
    stats() and the prefix counters wait for it at most SNAPSHOT_WAIT_S, then read without
    the lock, so a scrape never stalls behind it. (The holder here keeps the lock until the
    reads are done: reads that waited for it would never return, and the join would time out.)"""
    import kvpool.lifecycle

    monkeypatch.setattr(kvpool.lifecycle, "SNAPSHOT_WAIT_S", 0.05)
    kw = {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4} if hybrid else {}
    pool = kvpool.KVPool(2, 1, 2, dtype=torch.float32, page_size=2, num_pages=16, max_requests=4,
                         max_context_len=32, **kw)
    held, done, got = threading.Event(), threading.Event(), []

    def transfer_like():
        with pool._lock:
            held.set()
            done.wait(30)

    holder = threading.Thread(target=transfer_like, daemon=True)
    holder.start()
    assert held.wait(10)
    reader = threading.Thread(target=lambda: got.append((pool.stats(), pool.hit_tokens, pool.miss_tokens)),
                              daemon=True)
    reader.start()
    reader.join(20)
    done.set()
    holder.join(10)
    assert got, "stats() waited for the lock's holder past SNAPSHOT_WAIT_S"
    stats = got[0][0]
    assert (stats["open_requests"] if hybrid else stats.open_requests) == 0
