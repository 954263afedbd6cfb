"""kvpool.metrics: the text exposition a Prometheus scrape gets, checked against
the pools' own counters after a scripted workload."""

import numpy as np
import pytest
import torch

import kvpool

prometheus_client = pytest.importorskip("prometheus_client", reason="the metrics extra is not installed")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvpool.events import LocalEventPublisher  # noqa: E402
from kvpool.metrics import KVPoolCollector  # noqa: E402

P = 4


def scrape(collector):
    reg = prometheus_client.CollectorRegistry()
    reg.register(collector)
    text = prometheus_client.generate_latest(reg).decode()
    out = {}
    types = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out, types, text


def v(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def test_scrape_matches_the_pools_counters_after_a_workload():
    pool = kvpool.KVPool(2, 2, 8, dtype=torch.float32, num_pages=40, page_size=P, max_requests=8,
                         max_context_len=128)
    alloc = kvpool.SlotAllocator(12, P, 4, 64, hash_seed=1)
    pub = LocalEventPublisher(alloc)
    # KVPool: a shared prefix (hits), a fork whose partly filled last page is copied on write.
    prompt = np.arange(10, 23)  # 13 tokens: 3 full pages
    h, c = pool.open_with_prefix(prompt, [13])
    pool.extend(h, 13 - int(c[0]))
    pool.close(h, cache=True)
    h2, c2 = pool.open_with_prefix(prompt, [13])
    assert int(c2[0]) == 12
    pool.extend(h2, 1)
    forks = pool.fork(int(h2[0]), 2)
    pool.extend(forks, 1, tokens=[7, 8])  # each fork copies the shared last page's 1 slot
    assert pool.copied_slots == 2
    # SlotAllocator: caching, evictions (events published), then a held request.
    for i in range(6):
        t = np.arange(100 * i, 100 * i + 9)
        hh, _ = alloc.open_with_prefix(t, [9])
        alloc.extend(hh, 9)
        alloc.close(hh, cache=True)
    pub.publish()
    held, _ = alloc.open_with_prefix(np.arange(9), [9])
    alloc.extend(held, 9)
    samples, types, text = scrape(KVPoolCollector({"kv": pool, "alloc": alloc}, publishers={"alloc": pub}))

    for name, p in (("kv", pool), ("alloc", alloc)):
        s = p.stats()
        free = v(samples, "kvpool_pages", pool=name, state="free")
        held_pages = v(samples, "kvpool_pages", pool=name, state="held")
        cached = v(samples, "kvpool_pages", pool=name, state="cached")
        assert (free, held_pages, cached) == (s.free_pages - s.evictable_pages, s.used_pages, s.evictable_pages)
        assert free + held_pages + cached == p.capacity_pages
        assert v(samples, "kvpool_usage_ratio", pool=name) == pytest.approx(s.used_pages / p.capacity_pages)
        assert v(samples, "kvpool_registered_pages", pool=name) == s.cached_pages
        assert v(samples, "kvpool_open_requests", pool=name) == s.open_requests
        assert v(samples, "kvpool_prefix_cache_queries_total", pool=name) == s.hit_tokens + s.miss_tokens
        assert v(samples, "kvpool_prefix_cache_hits_total", pool=name) == s.hit_tokens
        assert v(samples, "kvpool_events_dropped_total", pool=name) == p.dropped_events
    # Hits are the tokens not recomputed: 12 of the second prompt's 13 (the last is always computed).
    assert v(samples, "kvpool_prefix_cache_hits_total", pool="kv") == 12
    assert v(samples, "kvpool_prefix_cache_queries_total", pool="kv") == 26
    assert v(samples, "kvpool_open_requests", pool="kv") == 3
    assert v(samples, "kvpool_evicted_pages_total", pool="alloc") == pub.removed_pages > 0
    assert v(samples, "kvpool_events_published_total", pool="alloc") == pub.events
    assert v(samples, "kvpool_copy_bytes_total", pool="kv") == 2 * pool.bytes_per_slot
    assert ("kvpool_evicted_pages_total", (("pool", "kv"),)) not in samples, "no publisher, no eviction count"
    assert "kvpool_offload_bytes" not in text, "no host tier, no offload family"
    assert types["kvpool_pages"] == "gauge" and types["kvpool_prefix_cache_hits"] == "counter"
    assert all(name.startswith("kvpool_") for name in types)


def test_a_single_pool_is_labelled_0_and_unknown_publishers_are_refused():
    alloc = kvpool.SlotAllocator(8, 1, 2, 8)
    samples, _, _ = scrape(KVPoolCollector(alloc))
    assert v(samples, "kvpool_pages", pool="0", state="free") == 7
    with pytest.raises(kvpool.InvalidArgumentError, match="unknown pools"):
        KVPoolCollector([alloc], publishers={"x": LocalEventPublisher(alloc)})


def test_a_tiered_pool_exports_its_offload_and_load_bytes():
    pool = kvpool.KVPool(2, 2, 8, dtype=torch.float32, num_pages=5, page_size=P, max_requests=4,
                         max_context_len=64, host_pages=16)
    prompt = list(range(100, 100 + 2 * P + 1))
    h, _ = pool.open_with_prefix(prompt, [len(prompt)])
    pool.extend(h, len(prompt))
    pool.close(h, cache=True)
    other = list(range(900, 900 + pool.free_pages * P - 1))  # evicts (offloads) the prefix
    h, _ = pool.open_with_prefix(other, [len(other)])
    pool.extend(h, len(other))
    pool.close(h)
    h, _ = pool.open_with_prefix(prompt, [len(prompt)])  # loads it back
    samples, types, _ = scrape(KVPoolCollector(pool))
    assert pool.offload_bytes == pool.load_bytes == 2 * pool.host.page_bytes > 0
    assert v(samples, "kvpool_offload_bytes_total", pool="0") == pool.offload_bytes
    assert v(samples, "kvpool_load_bytes_total", pool="0") == pool.load_bytes
    assert types["kvpool_offload_bytes"] == "counter"


def test_every_family_parses_with_valid_names_and_labels_and_counters_end_in_total():
    """Both exposition formats, every family present (a tiered KVPool, an allocator
    with a publisher, a label that needs escaping), read back by prometheus_client's
    own parsers."""
    import re

    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_parse

    pool = kvpool.KVPool(1, 1, 4, dtype=torch.float32, num_pages=8, page_size=P, max_requests=4,
                         max_context_len=64, host_pages=8)
    alloc = kvpool.SlotAllocator(16, P, 4, 64, hash_seed=3)
    pub = LocalEventPublisher(alloc)
    reg = prometheus_client.CollectorRegistry()
    reg.register(KVPoolCollector({'kv "0"\\\n': pool, "alloc": alloc}, publishers={"alloc": pub}))
    name_ok, label_ok = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*"), re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
    text = prometheus_client.generate_latest(reg).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert len(families) == 22 and {f.name for f in openmetrics_parse(openmetrics_latest(reg).decode())} == set(families)
    for name, fam in families.items():
        assert name_ok.fullmatch(name) and name.startswith("kvpool_") and not name.endswith("_total")
        assert fam.type in ("gauge", "counter") and fam.samples
        for s in fam.samples:
            assert s.name == (name + "_total" if fam.type == "counter" else name)
            assert all(label_ok.fullmatch(k) and not k.startswith("__") for k in s.labels)
            assert s.labels["pool"] in ('kv "0"\\\n', "alloc")
    assert {n for n, f in families.items() if f.type == "counter"} == {
        "kvpool_prefix_cache_queries", "kvpool_prefix_cache_hits", "kvpool_events_dropped", "kvpool_evicted_pages",
        "kvpool_events_published", "kvpool_copy_bytes", "kvpool_offload_bytes", "kvpool_load_bytes",
        "kvpool_offloaded_pages", "kvpool_loaded_pages", "kvpool_host_prefix_cache_hits"}


def test_pinned_pages_and_priority_bands_are_exported():
    """Pinned cached pages are their own state (neither free nor held), the pin
    count and bound are exported, and evictable pages are split around the
    default priority."""
    pool = kvpool.KVPool(1, 1, 4, dtype=torch.float32, num_pages=21, page_size=P, max_requests=4,
                         max_context_len=64, max_pinned_pages=3, manual_clock=True)
    for i, (prio, retain) in enumerate([(100, None), (10, None), (None, None), (70, 5.0)]):
        h, c = pool.open_with_prefix(np.arange(100 * i, 100 * i + 9), [9])  # 2 full pages
        pool.extend(h, 9 - int(c[0]))
        pool.close(h, cache=True, priority=prio, retain_s=retain)
    held, _ = pool.open_with_prefix(np.arange(1000, 1005), [5])
    pool.extend(held, 5)
    samples, types, _ = scrape(KVPoolCollector({"kv": pool}))
    state = {s: v(samples, "kvpool_pages", pool="kv", state=s) for s in ("free", "held", "cached", "pinned")}
    assert state == {"free": 10, "held": 2, "cached": 6, "pinned": 2}
    assert sum(state.values()) == pool.capacity_pages
    assert v(samples, "kvpool_pinned_pages", pool="kv") == pool.pinned_pages == 2
    assert v(samples, "kvpool_max_pinned_pages", pool="kv") == 3
    band = {b: v(samples, "kvpool_evictable_pages_by_priority", pool="kv", band=b) for b in ("low", "default", "high")}
    assert band == {"low": 2, "default": 2, "high": 2}
    pool.set_clock(5.0)  # the 70 ends: its pages have the default
    samples, _, _ = scrape(KVPoolCollector({"kv": pool}))
    assert v(samples, "kvpool_evictable_pages_by_priority", pool="kv", band="default") == 4
    assert types["kvpool_pinned_pages"] == "gauge"


def test_a_second_collector_of_the_same_families_is_refused_at_registration():
    """Two collectors in one registry would expose every family twice (and two
    unlabelled pools the same series, pool="0", twice), which a Prometheus scrape
    rejects: the registry must refuse the second one; one collector of both pools works."""
    a, b = kvpool.SlotAllocator(8, 1, 2, 8), kvpool.SlotAllocator(8, 1, 2, 8)
    reg = prometheus_client.CollectorRegistry()
    reg.register(KVPoolCollector(a))
    with pytest.raises(ValueError, match="Duplicated"):
        reg.register(KVPoolCollector(b))
    samples, _, text = scrape(KVPoolCollector({"a": a, "b": b}))
    assert text.count("# HELP kvpool_pages ") == 1
    assert v(samples, "kvpool_pages", pool="a", state="free") == v(samples, "kvpool_pages", pool="b", state="free") == 7


@pytest.mark.parametrize("make", [
    lambda: [kvpool.SlotAllocator(8, 1, 2, 8), object()], lambda: {"a": kvpool.SlotAllocator(8, 1, 2, 8), "b": "not a pool"},
], ids=["object-in-list", "str-in-mapping"])
def test_what_the_collector_cannot_read_is_refused_at_construction_not_at_every_scrape(make):
    """A scrape that raises fails the whole /metrics page, every other pool's
    families included: a pool the collector cannot read is a typed error when
    the collector is built."""
    with pytest.raises(kvpool.InvalidArgumentError, match="KVPool or SlotAllocator"):
        KVPoolCollector(make())


def test_labels_that_collide_and_publishers_that_are_not_publishers_are_refused():
    a, b = kvpool.SlotAllocator(8, 1, 2, 8), kvpool.SlotAllocator(8, 1, 2, 8)
    with pytest.raises(kvpool.InvalidArgumentError, match="label"):
        KVPoolCollector({0: a, "0": b})  # both would be pool="0": one pool would vanish
    with pytest.raises(kvpool.InvalidArgumentError, match="publisher"):
        KVPoolCollector({"a": a}, publishers={"a": object()})
    samples, _, _ = scrape(KVPoolCollector({0: a, 1: b}))
    assert v(samples, "kvpool_pages", pool="1", state="free") == 7
