"""An outside sweep of the monitoring and retention surfaces: the prefix-cache
counters a scrape reads while another thread's call is half done (an open the
pool undoes after the core counted its prompt), and the retention eviction order
at page sizes 1 and 16 with multi-page chains, prefix sharing, forks and
truncates, against a reference model written apart from the pool's."""

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


# ----- retention: eviction order, priorities and pins against an outside model -----

from review_retention_model import run as run_retention  # noqa: E402


@pytest.mark.parametrize(("page_size", "num_pages", "max_pinned"),
                         [(1, 14, 3), (1, 24, 6), (1, 40, 3), (16, 6, 2), (16, 9, 1), (16, 14, 3)])
def test_eviction_follows_priorities_then_lru_with_chains_forks_and_truncates(page_size, num_pages, max_pinned):
    """Every eviction (evict(n), and pages an open or extend takes under pressure) is the
    next page of the model's order: lowest priority, then least recently used; the counts
    by priority, the pins and unpin's answers agree after every call. (Seeds 8 and 23 of
    the first two rows found the truncation below.)"""
    evicted = pressure = 0
    for seed in range(30):
        m = run_retention(seed, page_size, num_pages, max_pinned)
        evicted, pressure = evicted + m.evicted, pressure + m.pressure
    assert evicted > 100 and pressure > 10, "the traces reached eviction, under pressure too"


def duplicated_pinned_prefix():
    """Request A caches a 3-page prompt and pins it; B computed the same prompt apart,
    so its cache() kept A's copies: B's cached prefix is A's pages."""
    a = kvpool.SlotAllocator(20, 1, 8, 64, hash_seed=1, manual_clock=True, max_pinned_pages=10)
    A, _ = a.admit([3], tokens=[2000, 2001, 2002])
    a.cache(A)
    B, _ = a.admit([3], tokens=[2000, 2001, 2002])
    a.cache(B)
    a.cache(A, priority=100)
    assert a.pinned_pages == 3
    return a, A, B


@pytest.mark.xfail(strict=True, reason=(
    "known limit (docs/allocator.md, retention): truncating B restarts its chain where the last "
    "page kept duplicated content, so unpin(B) returns 0 until B's next cache(). Resuming at the "
    "kept copy (tried at stop 77) failed the grouped allocator's property test "
    "(rust/kvpool-core/tests/groups_model.rs): the copy is another request's page, which B does not "
    "hold, so it can go before B's next cache(). A strict xfail, so that a fix shows here"))
@pytest.mark.parametrize("keep", [1, 2])
def test_unpin_after_a_truncation_still_reaches_the_kept_copies(keep):
    """Truncating B (a rollback, rejected draft tokens) where the last page it keeps
    duplicated content A cached should keep B's cached prefix (A's copies), so that
    unpin(B) reaches them and B's next pages register under them."""
    a, A, B = duplicated_pinned_prefix()
    a.truncate(B, [keep])
    assert a.unpin(B) == keep
    assert a.pinned_pages == 3 - keep
    a.check()
    # B's chain goes on from the kept copy: what it computes next registers under it.
    a.extend(B, [2], tokens=[7, 8])
    a.cache(B)
    a.close(A)
    h, c = a.open_with_prefix([2000, 2001, 2002][:keep] + [7, 8, 9], [keep + 3])
    assert int(c[0]) == keep + 2
    a.check()
