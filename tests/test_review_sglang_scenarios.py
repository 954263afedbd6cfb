"""SGLang's radix-cache expectations (test/srt/test_radix_cache_unit.py, the SWA and HiCache radix
cache tests, mem_cache/evict_policy.py) replayed on kvpool's public API, CPU only.

SGLang's RadixCache calls map onto kvpool's so: insert = `cache()` / `close(cache=True)`,
match_prefix = `open_with_prefix`, inc_lock_ref / dec_lock_ref = holding pages by an open request
(a hit takes them, `close` lets them go), evictable_size / protected_size = `evictable_pages` and
the registered pages requests hold (`cached_pages - evictable_pages` without pins), extra_key =
`salt`, evict = `evict`. Where kvpool differs by design a comment says so; the differences are:
kvpool caches full pages only and counts pages (SGLang pages too at page_size > 1); a hit leaves at
least one token to compute (SGLang's scheduler caps at len - 1 as well); `evict(n)` frees exactly
min(n, evictable) pages instead of "at least n"; of evict_policy.py's policies kvpool has LRU and
SGLang's priority rule (lowest priority first, LRU within one, the highest a page was given wins),
not LFU / FIFO / MRU / FILO / SLRU.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvpool

DEFAULT = kvpool.DEFAULT_PRIORITY


def make(page_size: int = 4, num_pages: int | None = None, **kw) -> kvpool.SlotAllocator:
    """64 slots by default, so the scenarios below run without pressure unless they make it."""
    return kvpool.SlotAllocator(num_pages=num_pages or 64 // page_size + 1, page_size=page_size, max_requests=8,
                                max_context_len=128, hash_seed=7, handle_seed=7, manual_clock=True, **kw)


def serve(a, prompt, salt=None, **close_kw) -> tuple[int, np.ndarray]:
    """One request: prefix hit, prefill of the rest, close with caching. Returns (hit, slots)."""
    h, c = a.open_with_prefix(np.asarray(prompt), [len(prompt)], salt=salt)
    a.extend(h, len(prompt) - int(c[0]))
    slots = a.slots(int(h[0]))
    a.close(h, cache=True, **close_kw)
    a.check()
    return int(c[0]), slots


def probe(a, prompt, salt=None) -> tuple[int, np.ndarray]:
    """match_prefix without side effects beyond the LRU touch: open on the prompt, read, close."""
    h, c = a.open_with_prefix(np.asarray(prompt), [len(prompt)], salt=salt)
    slots = a.slots(int(h[0]))
    a.close(h)
    return int(c[0]), slots


def balanced(a) -> None:
    """SGLang: evictable_size + protected_size == total cached. kvpool: free_pages counts FREE plus
    evictable pages, used_pages the held ones, pinned pages nobody holds are neither."""
    s = a.stats()
    assert s.evictable_pages <= s.cached_pages
    assert sum(s.evictable_pages_by_priority) == s.evictable_pages
    assert 0 <= a.capacity_pages - s.used_pages - s.free_pages <= s.pinned_pages
    a.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_then_match_serves_the_written_slots_and_a_split_keeps_both_halves(page_size):
    a = make(page_size)
    prompt = list(range(100, 112))
    assert serve(a, prompt)[0] == 0
    _, first = serve(a, prompt + [1])
    hit, slots = probe(a, prompt + [2])
    assert hit == 12 and np.array_equal(slots, first[:12])
    # A prompt diverging at token 8 splits SGLang's node; kvpool's chain branches at page 2.
    branch = prompt[:8] + list(range(500, 504))
    assert serve(a, branch + [3])[0] == 8
    assert probe(a, prompt + [4])[0] == 12, "the original half stays matchable"
    assert probe(a, branch + [5])[0] == 12, "the new half is matchable"
    assert probe(a, prompt[:8] + [9])[0] == 8, "and the shared part alone"
    balanced(a)


def test_a_match_ending_mid_page_rounds_down_to_a_page():
    a = make(4)
    prompt = list(range(200, 214))  # 14 tokens: 3 full pages, 2 tokens of a 4th that is never cached
    serve(a, prompt)
    assert a.cached_pages == 3
    assert probe(a, prompt + [1])[0] == 12
    assert probe(a, prompt[:10] + [1])[0] == 8
    assert probe(a, prompt[:6] + [7, 7, 7])[0] == 4, "a divergence inside page 2 keeps page 1 only"
    # kvpool (like SGLang's scheduler, which matches input_ids[:-1]) leaves a token to compute:
    # the whole 12 cached tokens as a 12-token prompt hit 8.
    assert probe(a, prompt[:12])[0] == 8


def test_caching_content_already_present_keeps_one_copy():
    """SGLang's insert of a present key returns its length and keeps the old value. kvpool keeps
    the existing entry while someone holds it; an unheld old copy gives way to the new page
    (docs/allocator.md, Duplicates), so the cache still holds one copy and the count is stable."""
    a = make(4)
    prompt = list(range(300, 312))
    h1, _ = a.open_with_prefix(np.array(prompt + [0]), [13])
    h2, _ = a.open_with_prefix(np.array(prompt + [0]), [13])  # both miss: computed twice
    a.extend(h1, 13)
    a.extend(h2, 13)
    a.cache(h1)
    pages_1 = a.pages(int(h1[0]))[:3].tolist()
    a.cache(h2)  # h1 holds the entries: h2's copies stay unregistered
    assert a.cached_pages == 3 and a.evictable_pages == 0
    a.close(h2, cache=True)
    assert a.cached_pages == 3 and a.used_pages == 4, "h2's duplicate pages went free, not cached"
    a.close(h1, cache=True)
    assert probe(a, prompt + [1])[0] == 12
    assert a.pages(int(a.open_with_prefix(np.array(prompt + [1]), [13])[0][0]))[:3].tolist() == pages_1
    a.reset()
    # The unheld case: the old copy is cached, a request recomputed it.
    h3 = a.open(1)
    a.extend(h3, 12, tokens=np.array(prompt))
    a.cache(h3)
    assert a.cached_pages == 3, "one copy of each page"
    new_pages = a.pages(int(h3[0])).tolist()
    assert not set(new_pages) & set(pages_1), "recomputed in other pages"
    a.close(h3)
    assert a.evictable_pages == 3 and a.used_pages == 0
    h4, c4 = a.open_with_prefix(np.array(prompt + [1]), [13])
    assert int(c4[0]) == 12 and a.pages(int(h4[0])).tolist() == new_pages
    a.close(h4)
    balanced(a)


def test_salts_isolate_prefixes_like_extra_key():
    a = make(1)
    prompt = [1, 2, 3]
    slots = {salt: serve(a, prompt, salt=salt)[1] for salt in (1, 2, 0)}
    assert len({tuple(s) for s in slots.values()}) == 3
    for salt, s in slots.items():
        hit, got = probe(a, prompt + [9], salt=salt)
        assert hit == 3 and np.array_equal(got, s)
    assert probe(a, prompt + [9], salt=12345)[0] == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_holding_a_prefix_moves_its_pages_from_evictable_to_protected(page_size):
    a = make(page_size)
    prompt = list(range(12))
    serve(a, prompt)
    n = 12 // page_size
    assert (a.cached_pages, a.evictable_pages) == (n, n)
    held = 8 // page_size
    h1, c1 = a.open_with_prefix(np.array(prompt[:8] + [99]), [9])
    assert int(c1[0]) == 8
    assert (a.cached_pages, a.evictable_pages, a.used_pages) == (n, n - held, held)
    h2, _ = a.open_with_prefix(np.array(prompt[:8] + [98]), [9])  # a second lock on the same pages
    assert (a.evictable_pages, a.used_pages) == (n - held, held)
    a.close(h1)
    assert a.evictable_pages == n - held, "still locked by h2"
    a.close(h2)
    assert (a.evictable_pages, a.used_pages) == (n, 0)
    balanced(a)


def test_evict_takes_exactly_what_it_is_asked_tails_first_and_never_a_held_page():
    a = make(4)
    long_prompt, short = list(range(1000, 1016)), list(range(2000, 2008))
    serve(a, long_prompt)  # 4 pages
    serve(a, short)  # 2 pages, released later: newer in the LRU
    h, c = a.open_with_prefix(np.array(long_prompt[:8] + [1]), [9])  # lock long's first 2 pages
    held = a.pages(int(h[0])).tolist()
    free_before = a.free_pages
    assert a.evictable_pages == 4
    assert a.evict(1) == 1  # long's tail page: least recent, a leaf
    assert probe(a, long_prompt + [1])[0] == 12
    assert probe(a, short + [1])[0] == 8
    assert a.evict(1) == 1  # long's 3rd page: the probes above touched short after long
    assert probe(a, long_prompt + [1])[0] == 8
    assert a.evict(10) == 2, "only the unheld pages go; min(n, evictable), not more"
    assert (a.evictable_pages, a.cached_pages) == (0, 2)
    assert a.free_pages == free_before, "evicting moves pages between two kinds of free"
    assert a.evict(5) == 0
    assert a.pages(int(h[0])).tolist() == held
    g = a.open(1)
    new = a.extend(g, a.free_slots)
    assert not set(new // 4) & set(held), "no held page was handed out"
    a.close(g)
    assert probe(a, long_prompt + [1])[0] == 8
    a.close(h)
    balanced(a)


def test_a_hit_refreshes_lru_order():
    a = make(1)
    serve(a, [1, 2, 3, 4])
    serve(a, [5, 6, 7, 8])
    probe(a, [1, 2, 3, 4, 0])  # SGLang's match_prefix bumps last_access_time; kvpool's hit relinks
    assert a.evict(4) == 4
    assert probe(a, [1, 2, 3, 4, 0])[0] == 4
    assert probe(a, [5, 6, 7, 8, 0])[0] == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_priorities_evict_lowest_first_then_lru(page_size):
    a = make(page_size, num_pages=64 // page_size + 1)
    P = page_size
    prompts = {name: [base + i for i in range(2 * P)] for name, base in
               (("low_old", 100), ("default", 200), ("high", 300), ("low_new", 400))}
    serve(a, prompts["low_old"], priority=10)
    serve(a, prompts["default"])
    serve(a, prompts["high"], priority=80)
    serve(a, prompts["low_new"], priority=10)
    by = a.evictable_pages_by_priority()
    assert (by[10], by[DEFAULT], by[80]) == (4, 2, 2)
    order = []
    for _ in range(4):
        assert a.evict(2) == 2
        order.append([n for n, p in prompts.items() if probe(a, p + [0])[0] == 0 and n not in sum(order, [])])
    assert order == [["low_old"], ["low_new"], ["default"], ["high"]]
    balanced(a)


def test_a_shared_prefix_keeps_the_highest_priority_any_request_gave():
    a = make(4, num_pages=33)
    system = list(range(50, 58))  # 2 pages
    serve(a, system + list(range(600, 604)), priority=0)
    serve(a, system + list(range(700, 704)), priority=90)
    by = a.evictable_pages_by_priority()
    assert (by[0], by[90]) == (1, 3), "the shared pages took 90; each tail kept its own"
    assert a.evict(1) == 1
    assert probe(a, system + list(range(600, 604)) + [0])[0] == 8
    assert probe(a, system + list(range(700, 704)) + [0])[0] == 12



def test_an_ended_priority_joins_the_default_pages_as_the_newest_tail_first():
    """SGLang's PriorityStrategy has no durations; kvpool's retain_s (TensorRT-LLM's) ends on the
    clock, and the page then ranks as a default page used just now, a chain's tail still older."""
    A, B = list(range(100, 112)), list(range(200, 212))
    hits = []
    for k in range(1, 7):
        a = make(4)
        serve(a, A, priority=90, retain_s=2.0)
        serve(a, B)
        a.set_clock(2.0)
        assert a.evictable_pages_by_priority()[[DEFAULT, 90]].tolist() == [6, 0]
        assert a.evict(k) == k
        hits.append((probe(a, A + [0])[0], probe(a, B + [0])[0]))
    assert hits == [(12, 8), (12, 4), (12, 0), (8, 0), (4, 0), (0, 0)]


def test_a_recomputed_duplicate_takes_over_with_the_entrys_priority():
    """An unheld cached copy gives way to a recomputed one (docs/allocator.md, Duplicates); the
    entry keeps its priority, and a pin stays a pin."""
    for prio in (90, 100):
        a = make(4)
        prompt = list(range(100, 113))
        h, _ = a.open_with_prefix(np.array(prompt), [13])  # a miss: opened before the others cache
        serve(a, prompt, priority=prio)
        before = (a.evictable_pages_by_priority().tolist(), a.pinned_pages, a.cached_pages)
        a.extend(h, 13)
        a.cache(h)
        new = a.pages(int(h[0]))[:3].tolist()
        a.close(h)
        assert (a.evictable_pages_by_priority().tolist(), a.pinned_pages, a.cached_pages) == before
        assert probe(a, prompt)[1].tolist() == [p * 4 + o for p in new for o in range(4)]
        balanced(a)

@pytest.mark.parametrize("page_size", [1, 4])
def test_a_refused_extend_changes_nothing_not_even_the_eviction_order(page_size):
    P = page_size
    prompts = [[1000 * i + t for t in range(2 * P)] for i in range(3)]

    def scene():
        a = make(P, num_pages=9)  # 8 pages: 6 cached, then 2 held and 1 more
        for i, prio in enumerate([10, 50, 20]):
            serve(a, prompts[i], priority=prio)
        hold, _ = a.open_with_prefix(np.array(prompts[0] + [7]), [2 * P + 1])
        a.extend(hold, 1)
        return a
    a, twin = scene(), scene()
    g, t = a.open(1), twin.open(1)
    before = a.stats()
    with pytest.raises(kvpool.PoolExhaustedError):
        a.extend(g, a.free_slots + 1)
    assert a.stats() == twin.stats() == before
    assert a.evictable_pages_by_priority().tolist() == twin.evictable_pages_by_priority().tolist()
    for k in range(4):  # eviction order: the same pages go, the same prompts keep hitting
        assert a.evict(1) == twin.evict(1) == 1
        hits = [probe(x, p + [0])[0] for x in (a, twin) for p in prompts]
        assert hits[:3] == hits[3:], k
    assert a.evict(1) == 0
    assert np.array_equal(a.extend(g, 3), twin.extend(t, 3))
    balanced(a)


# SWA radix cache (SGLang's SWARadixCache tests): a full group and a sliding group (window 8).
def make_swa() -> kvpool.GroupedAllocator:
    return kvpool.GroupedAllocator(
        [{"kind": "full", "num_pages": 33, "page_size": 4},
         {"kind": "sliding", "num_pages": 33, "page_size": 4, "window": 8}],
        max_requests=8, max_context_len=256, hash_seed=7, handle_seed=7)


def swa_serve(g, prompt) -> int:
    h, c = g.open_with_prefix(np.array(prompt), [len(prompt)])
    g.extend(h, len(prompt) - int(c[0]))
    g.close(h, cache=True)
    g.check()
    return int(c[0])


def swa_probe(g, prompt) -> int:
    h, c = g.open_with_prefix(np.array(prompt), [len(prompt)])
    g.close(h)
    return int(c[0])


def swa_balanced(g) -> None:
    for i in range(g.num_groups):
        assert g.evictable_pages(i) <= g.cached_pages(i)
        assert g.used_pages(i) + g.free_pages(i) == g.capacity_pages(i)
    g.check()


def test_swa_an_evicted_window_shortens_the_hit_though_the_full_group_has_it_all():
    g = make_swa()
    prompt = list(range(100, 124))  # 6 pages in both groups
    swa_serve(g, prompt)
    assert [g.cached_pages(i) for i in (0, 1)] == [6, 6]
    # The sliding group's least recent page is the chain's tail (tokens 20..23), which the window
    # of a 24-token hit needs; 20 needs tokens 13..19 only (SGLang: a tombstoned SWA node).
    assert g.evict(1, 1) == 1
    assert swa_probe(g, prompt + [0]) == 20
    assert g.cached_pages(0) == 6, "the full group kept every page"
    assert g.evict(1, 10) == 5
    assert swa_probe(g, prompt + [0]) == 0, "no window left anywhere: a miss (L = 0 needs none)"
    swa_balanced(g)


def test_swa_a_held_window_is_never_evicted():
    g = make_swa()
    prompt = list(range(200, 224))
    swa_serve(g, prompt)
    h, c = g.open_with_prefix(np.array(prompt[:16] + [1]), [17])
    assert int(c[0]) == 16
    held = g.pages(int(h[0]), 1).tolist()
    assert held[:2] == [0, 0] and 0 not in held[2:], "the window [9, 16) holds pages 3 and 4 only"
    assert g.evictable_pages(1) == 4 and g.evictable_pages(0) == 2
    assert g.evict(1, 100) == 4 and g.evict(0, 100) == 2
    assert g.pages(int(h[0]), 1).tolist() == held
    assert swa_probe(g, prompt[:16] + [2]) == 16, "the held pages still serve"
    g.close(h)
    swa_balanced(g)


def test_swa_a_refused_call_changes_no_group():
    g = make_swa()
    swa_serve(g, list(range(300, 340)))
    h = g.open(1)
    before = g.stats()
    with pytest.raises(kvpool.PoolExhaustedError):
        g.extend(h, 33 * 4)
    assert g.stats() == before and g.length(int(h[0])) == 0
    assert swa_probe(g, list(range(300, 340)) + [0]) == 40
    g.close(h)
    swa_balanced(g)


# HiCache (SGLang's HiRadixCache): device eviction backs pages up to the host; a hit loads them.
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_host_tier_keeps_evicted_prefixes_matchable(policy):
    a = make(4, host_pages=17, host_policy=policy)
    prompt = list(range(400, 412))
    serve(a, prompt)
    a.take_offloads()
    assert a.evict(3) == 3
    off_dev, off_host = a.take_offloads()
    assert len(off_dev) == (3 if policy == "write_back" else 0), "write_through copied at cache()"
    assert (a.cached_pages, a.host_cached_pages) == (0, 3)
    h, c = a.open_with_prefix(np.array(prompt + [0]), [13])
    assert int(c[0]) == 12 and a.host_hit_tokens == 12
    src, dst = a.take_loads()
    assert len(src) == 3 and sorted(dst.tolist()) == sorted(a.pages(int(h[0]))[:3].tolist())
    a.close(h)
    balanced(a)


def test_host_tier_never_drops_a_held_page():
    a = make(4, num_pages=9, host_pages=5)
    serve(a, list(range(500, 516)))  # 4 pages
    h, _ = a.open_with_prefix(np.array(list(range(500, 508)) + [0]), [9])
    held = a.pages(int(h[0])).tolist()
    assert a.evict(100) == 2
    g = a.open(1)
    new = a.extend(g, a.free_slots)
    assert not set((new // 4).tolist()) & set(held)
    with pytest.raises(kvpool.PoolExhaustedError):
        a.extend(g, 1)
    assert a.pages(int(h[0])).tolist() == held
    a.close(g)
    a.close(h)
    balanced(a)
