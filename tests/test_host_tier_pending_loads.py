"""A device page with a load still queued into it (swap_in) holds nothing yet: the
queued offloads run before the loads, so a host copy made of it before the load is
taken (cache() under write_through, an eviction under write_back) would copy what
the page held before, and a later hit on that copy would serve it. Driven as an
engine drives SlotAllocator directly: the queues are drained once, before the
step's writes, with calls that need no step (swap_in, cache, close, evict) in
between."""

import numpy as np
import pytest

import kvpool

P = 4


class Sim:
    """Simulated page contents moved as the drained queues say."""

    def __init__(self, a, host_pages):
        self.a = a
        self.dev = np.zeros((a.num_pages, P), dtype=np.int64)
        self.host = np.zeros((host_pages, P), dtype=np.int64)

    def drain(self):
        for d, h in zip(*self.a.take_offloads()):
            self.host[h] = self.dev[d]
        for h, d in zip(*self.a.take_loads()):
            self.dev[d] = self.host[h]
        for s, d in zip(*self.a.take_copies()):
            self.dev[d // P, d % P] = self.dev[s // P, s % P]


def swapped_back(policy):
    """A request that wrote one full page is swapped out and back in: its page's
    load is queued, not run."""
    a = kvpool.SlotAllocator(6, P, 4, 4 * P, hash_seed=1, host_pages=6, host_policy=policy)
    sim = Sim(a, 6)
    toks = np.arange(100, 100 + P)
    h = int(a.open(1)[0])
    slots = a.extend(h, P, tokens=toks)
    sim.drain()
    sim.dev[slots // P, slots % P] = toks  # the step's writes: the token ids stand for K/V
    a.swap_out(h)
    sim.drain()
    sim.dev[:] = 0  # the freed device pages are written by other requests
    a.swap_in(h)
    return a, sim, h, toks


def assert_hit_serves(a, sim, toks):
    """A prompt of toks and one more token opens on the cache: a hit (if the entry
    kept a copy) serves the tokens' K/V; a miss is fine."""
    prompt = np.concatenate([toks, [7]])
    rs, c = a.open_with_prefix(prompt, [len(prompt)])
    sim.drain()
    s = a.slots(int(rs[0]))[: int(c[0])]
    assert sim.dev[s // P, s % P].tolist() == toks.tolist()[: int(c[0])]


def test_write_through_cache_of_a_page_still_loading():
    a, sim, h, toks = swapped_back("write_through")
    a.cache(h)
    a.check()
    sim.drain()
    assert sim.dev[a.pages(h)[0]].tolist() == toks.tolist()
    # Every host copy the cache has holds its tokens' K/V.
    a.close(h)
    a.evict(a.cached_pages)  # a hit now comes from the host tier
    a.check()
    sim.drain()
    assert_hit_serves(a, sim, toks)


def test_write_back_eviction_of_a_page_still_loading():
    a, sim, h, toks = swapped_back("write_back")
    a.close(h, cache=True)
    assert a.evict(1) == 1  # write_back: the evicted page's entry would get a host copy
    a.check()
    sim.drain()
    sim.dev[:] = 0  # the evicted page is written by another request
    assert_hit_serves(a, sim, toks)


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_no_offload_reads_a_page_whose_load_is_queued(policy):
    a, sim, h, _ = swapped_back(policy)
    a.cache(h)
    a.close(h, cache=True)
    a.evict(a.cached_pages)
    loads = set(a.take_loads()[1].tolist())
    offloads = set(a.take_offloads()[0].tolist())
    assert not loads & offloads
