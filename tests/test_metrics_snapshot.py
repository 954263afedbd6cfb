"""kvpool.metrics: one scrape is one stats() snapshot per pool (the priority
bands add up to the cached pages even while another thread works), the host
tier's families, and what the collector refuses."""

import pickle
import threading

import numpy as np
import pytest
import torch

import kvpool

prometheus_client = pytest.importorskip("prometheus_client", reason="the metrics extra is not installed")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvpool.events import LocalEventPublisher  # noqa: E402
from kvpool.metrics import KVPoolCollector  # noqa: E402

P = 4


def parse(reg):
    out = {}
    for fam in text_string_to_metric_families(prometheus_client.generate_latest(reg).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def v(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def test_stats_carry_the_priority_counts_and_dropped_events_of_the_same_read():
    alloc = kvpool.SlotAllocator(12, P, 4, 64, hash_seed=1, manual_clock=True)
    for i, prio in enumerate([10, None, 90]):
        h, _ = alloc.open_with_prefix(np.arange(100 * i, 100 * i + 9), [9])
        alloc.extend(h, 9)
        alloc.close(h, cache=True, priority=prio)
    s = alloc.stats()
    by = s.evictable_pages_by_priority
    assert len(by) == kvpool.MAX_PRIORITY + 1 and sum(by) == s.evictable_pages == 6
    assert (by[10], by[kvpool.DEFAULT_PRIORITY], by[90]) == (2, 2, 2)
    assert by == alloc.evictable_pages_by_priority().tolist()
    assert s.dropped_events == alloc.dropped_events == 0
    assert "dropped_events=0" in repr(s) and "evictable_pages_by_priority={10:2,35:2,90:2}" in repr(s)
    back = pickle.loads(pickle.dumps(s))
    assert back == s and back.evictable_pages_by_priority == by
    from kvpool._core import _pool_stats
    # Old pickles load (tests/test_review_poolstats_pickle.py); a flat list of another
    # length is no layout any kvpool pickled.
    with pytest.raises(kvpool.InvalidArgumentError, match="flat list of 17 counters"):
        _pool_stats([0] * 18)


def test_dropped_events_in_a_scrape_come_from_the_snapshot():
    alloc = kvpool.SlotAllocator(4, 1, 2, 8, hash_seed=1, kv_events=True)
    # Fill the undrained backlog past its bound (max(num_pages, 65536) events).
    for i in range(33000):
        h, _ = alloc.open_with_prefix([2 * i, 2 * i + 1], [2])
        alloc.extend(h, 2)
        alloc.close(h, cache=True)
    s = alloc.stats()
    assert s.dropped_events == alloc.dropped_events > 0
    reg = prometheus_client.CollectorRegistry()
    reg.register(KVPoolCollector(alloc))
    assert v(parse(reg), "kvpool_events_dropped_total", pool="0") == s.dropped_events


@pytest.mark.parametrize("kind", ["SlotAllocator", "KVPool"])
def test_every_scrape_s_priority_bands_add_up_to_its_cached_pages_while_another_thread_churns(kind):
    """The bands used to be read after stats(), under a lock of their own: a close
    landing between the two reads made one scrape's bands disagree with its own
    cached count."""
    if kind == "KVPool":
        pool = kvpool.KVPool(1, 1, 4, dtype=torch.float32, num_pages=24, page_size=P, max_requests=8,
                             max_context_len=64)
    else:
        pool = kvpool.SlotAllocator(24, P, 8, 64, hash_seed=2)
    reg = prometheus_client.CollectorRegistry()
    reg.register(KVPoolCollector({"p": pool}))
    done = threading.Event()
    ops = [0]

    def churn() -> None:
        rng = np.random.default_rng(1)
        while not done.is_set() and ops[0] < 200_000:
            base, n = int(rng.integers(0, 12)) * 100, int(rng.integers(1, 30))
            h, c = pool.open_with_prefix(np.arange(base, base + n), [n])
            pool.extend(h, n - int(c[0]))
            pool.close(h, cache=True, priority=int(rng.integers(0, 101)))
            ops[0] += 1

    thread = threading.Thread(target=churn)
    thread.start()
    bad = []
    try:
        for _ in range(400):
            s = parse(reg)
            cached = v(s, "kvpool_pages", pool="p", state="cached")
            bands = [v(s, "kvpool_evictable_pages_by_priority", pool="p", band=b) for b in ("low", "default", "high")]
            if sum(bands) != cached:
                bad.append((cached, bands))
    finally:
        done.set()
        thread.join()
    assert ops[0] > 0 and bad == []
    pool.check()


def _serve(pool, prompt):
    h, c = pool.open_with_prefix(prompt, [len(prompt)])
    pool.extend(h, len(prompt) - int(c[0]))
    return h


@pytest.mark.parametrize("kind", ["KVPool", "SlotAllocator"])
def test_a_host_tier_exports_its_pages_transfers_and_host_hits(kind):
    if kind == "KVPool":
        pool = kvpool.KVPool(1, 1, 4, dtype=torch.float32, num_pages=6, page_size=P, max_requests=4,
                             max_context_len=64, host_pages=12)
    else:
        pool = kvpool.SlotAllocator(6, P, 4, 64, hash_seed=4, host_pages=12)
    reg = prometheus_client.CollectorRegistry()
    reg.register(KVPoolCollector({"t": pool}))
    prompt = np.arange(100, 100 + 2 * P + 1)
    pool.close(_serve(pool, prompt), cache=True)
    pool.close(_serve(pool, np.arange(900, 900 + pool.free_pages * P - 1)))  # evicts (offloads) the prompt
    pool.close(_serve(pool, prompt))  # hits it on the host: loaded back
    swapped = _serve(pool, np.arange(500, 500 + 2 * P))
    pool.swap_out(swapped)  # its 2 pages are held on the host
    if kind == "SlotAllocator":  # the transfers are the engine's to take (a KVPool runs them itself)
        pool.take_offloads()
        pool.take_loads()
    s, samples = pool.stats(), parse(reg)
    assert s.host_hit_tokens == 2 * P and s.offloaded_pages >= 4 and s.loaded_pages == 2
    assert v(samples, "kvpool_host_capacity_pages", pool="t") == 11
    assert v(samples, "kvpool_host_free_pages", pool="t") == s.host_free_pages
    assert v(samples, "kvpool_host_used_pages", pool="t") == 11 - s.host_free_pages == 2
    assert v(samples, "kvpool_host_registered_pages", pool="t") == s.host_cached_pages > 0
    assert v(samples, "kvpool_offloaded_pages_total", pool="t") == s.offloaded_pages
    assert v(samples, "kvpool_loaded_pages_total", pool="t") == s.loaded_pages
    assert v(samples, "kvpool_host_prefix_cache_hits_total", pool="t") == s.host_hit_tokens
    assert v(samples, "kvpool_prefix_cache_hits_total", pool="t") >= s.host_hit_tokens
    if kind == "KVPool":
        assert v(samples, "kvpool_offload_bytes_total", pool="t") == pool.offload_bytes
        assert v(samples, "kvpool_load_bytes_total", pool="t") == pool.load_bytes == 2 * pool.host.page_bytes
    else:  # bytes are the torch layer's: an allocator has pages only
        assert ("kvpool_offload_bytes_total", (("pool", "t"),)) not in samples


def test_pools_without_a_host_tier_export_no_host_families():
    pool = kvpool.KVPool(1, 1, 4, dtype=torch.float32, num_pages=6, page_size=P, max_requests=4, max_context_len=64)
    reg = prometheus_client.CollectorRegistry()
    reg.register(KVPoolCollector([pool, kvpool.SlotAllocator(6, P, 4, 64)]))
    names = {name for name, _ in parse(reg)}
    assert "kvpool_pages" in names and not any("host" in n or "offload" in n or "loaded" in n for n in names)


def test_a_publisher_of_another_pool_or_two_publishers_for_one_label_are_refused():
    """Both used to be taken: the first exported one pool's evictions under the
    other's label, the second kept one of the two publishers and dropped the other unseen."""
    a, b = kvpool.SlotAllocator(8, 1, 2, 8), kvpool.SlotAllocator(8, 1, 2, 8)
    with pytest.raises(kvpool.InvalidArgumentError, match="another pool's events"):
        KVPoolCollector({"a": a, "b": b}, publishers={"a": LocalEventPublisher(b)})
    with pytest.raises(kvpool.InvalidArgumentError, match="two publishers"):
        KVPoolCollector([a], publishers={0: LocalEventPublisher(a), "0": LocalEventPublisher(a)})
    # A KVPool's publisher may be built on the pool or on its allocator.
    pool = kvpool.KVPool(1, 1, 4, dtype=torch.float32, num_pages=6, page_size=P, max_requests=4, max_context_len=64)
    KVPoolCollector({"p": pool, "a": a}, publishers={"p": LocalEventPublisher(pool.allocator), "a": LocalEventPublisher(a)})
    KVPoolCollector({"p": pool.allocator}, publishers={"p": LocalEventPublisher(pool)})


def test_one_collector_in_two_registries_and_twice_in_one_and_a_pool_reset_while_registered():
    alloc = kvpool.SlotAllocator(8, P, 4, 32, hash_seed=1)
    collector = KVPoolCollector({"a": alloc})
    r1, r2 = prometheus_client.CollectorRegistry(), prometheus_client.CollectorRegistry()
    r1.register(collector)
    r2.register(collector)  # non-default registries: each scrape reads the pool afresh
    with pytest.raises(ValueError, match="Duplicated"):
        r1.register(collector)
    h = _serve(alloc, np.arange(9))
    assert v(parse(r1), "kvpool_pages", pool="a", state="held") == v(parse(r2), "kvpool_pages", pool="a",
                                                                       state="held") == 3
    alloc.reset()  # every request closed: the handles go stale, the collector does not
    s = parse(r1)
    assert v(s, "kvpool_pages", pool="a", state="held") == v(s, "kvpool_open_requests", pool="a") == 0
    assert sum(v(s, "kvpool_pages", pool="a", state=st) for st in ("free", "held", "cached", "pinned")) == 7
    assert not alloc.is_open(int(h[0]))


def _hybrid_pool():
    return kvpool.KVPool(2, 2, 8, dtype=torch.float32, num_pages=40, page_size=P, max_requests=8,
                         max_context_len=128, layer_types=["full_attention", "sliding_attention"],
                         sliding_window=8)


def test_a_hybrid_pool_exports_each_layer_group_from_one_snapshot():
    """Hybrid pools used to be refused: their groups' pages were not exported at all."""
    pool = _hybrid_pool()
    pub = LocalEventPublisher(pool)
    reg = prometheus_client.CollectorRegistry()
    reg.register(KVPoolCollector({"h": pool}, publishers={"h": pub}))
    prompt = np.arange(100, 100 + 5 * P + 1)
    pool.close(_serve(pool, prompt), cache=True)
    held = _serve(pool, prompt)  # a hit
    pub.publish()
    samples = parse(reg)
    g = pool.allocator.stats()
    assert v(samples, "kvpool_open_requests", pool="h") == g["open_requests"] == 1
    assert v(samples, "kvpool_prefix_cache_hits_total", pool="h") == g["hit_tokens"] > 0
    assert v(samples, "kvpool_prefix_cache_queries_total", pool="h") == g["hit_tokens"] + g["miss_tokens"]
    assert v(samples, "kvpool_events_dropped_total", pool="h") == g["dropped_events"]
    assert v(samples, "kvpool_events_published_total", pool="h") == pub.events > 0
    kinds = [grp.kind for grp in pool.groups]
    assert len(kinds) == 2 and set(kinds) == {"full", "sliding"}
    for i, kind in enumerate(kinds):
        c = g["groups"][i]
        state = {st: v(samples, "kvpool_group_pages", pool="h", group=str(i), kind=kind, state=st)
                 for st in ("free", "held", "cached")}
        assert sum(state.values()) == c["capacity_pages"] == pool.allocator.capacity_pages(i)
        assert state["held"] == c["used_pages"] == pool.allocator.used_pages(i) > 0
        assert state["cached"] == c["evictable_pages"]
        assert v(samples, "kvpool_group_registered_pages", pool="h", group=str(i), kind=kind) == c["cached_pages"] > 0
    assert not any(name in ("kvpool_pages", "kvpool_copy_bytes_total") for name, _ in samples)
    pool.close(held)
    # A GroupedAllocator by itself is a pool too, and a hybrid pool and its allocator are one.
    assert v(parse(_registered(pool.allocator)), "kvpool_open_requests", pool="0") == 0
    with pytest.raises(kvpool.InvalidArgumentError, match="same pool"):
        KVPoolCollector([pool, pool.allocator])


def _registered(pools):
    reg = prometheus_client.CollectorRegistry()
    reg.register(KVPoolCollector(pools))
    return reg
