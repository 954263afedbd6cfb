"""Outside checker for KVPool (torch, CPU) at page size 1, with and without a
host tier: random prefix hits, forks, truncates, extends, caches, closes,
evictions, cache clears and swaps, writing K/V through the pool as a model step
would and reading it back with pool.read. The reference is a dict from
(salt, token prefix) to the K/V a model would compute there (a fresh value where
a token is unknown): every open request must read its own positions' values,
req_to_token must name its slots, and every page the events say is cached on
the device must hold the values of the tokens its Stored event named."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from review_page1_refs import Req, Router, prompts

import kvpool

MAX_REQ, MAX_CTX, LAYERS = 5, 12, 2
_vals = itertools.count(1)


class PoolMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.sampled_from([4, 7, 12, 16]), host_pages=st.sampled_from([0, 3, 8]),
                policy=st.sampled_from(["write_back", "write_through"]))
    def setup(self, num_pages, host_pages, policy):
        self.p = kvpool.KVPool(LAYERS, 1, 2, dtype=torch.float32, page_size=1, num_pages=num_pages,
                               max_requests=MAX_REQ, max_context_len=MAX_CTX, host_pages=host_pages,
                               host_policy=policy, hash_seed=3)
        self.host = host_pages > 0
        self.router = Router(1)
        self.host_router = Router(1, medium=1, spelled=self.router.spelled)  # what the events say the host holds
        self.value = {}  # content key -> float
        self.reqs, self.swapped = {}, set()

    def val(self, key):
        if key not in self.value:
            self.value[key] = float(next(_vals))
        return self.value[key]

    def events(self):
        ev = self.p.take_events()
        self.router.feed(ev)
        self.host_router.feed(ev)

    def rows_for(self, keys):
        v = torch.tensor([self.val(k) for k in keys], dtype=torch.float32)
        return v.view(-1, 1, 1).expand(-1, 1, 2).contiguous()

    def write(self, h, slots, start):
        keys = self.reqs[h].keys[start:start + len(slots)]
        k = self.rows_for(keys)
        for layer in range(LAYERS):
            self.p.write(layer, slots, k + 1000 * layer, -k - 1000 * layer)

    def on_device(self, data):
        live = sorted(set(self.reqs) - self.swapped)
        return data.draw(st.sampled_from(live))

    def extend_by(self, h, n, with_tokens):
        r, start = self.reqs[h], self.p.length(h)
        toks = [r.prompt[i] if i < len(r.prompt) else (i % 3 + 1 if with_tokens else None)
                for i in range(start, start + n)]
        try:
            res = self.p.extend([h], [n], tokens=toks if with_tokens else None)
        except (kvpool.PoolExhaustedError, kvpool.ContextTooLongError):
            assert start + n > MAX_CTX or n > self.p.stats().free_pages
            return
        for i, t in enumerate(toks):
            r.toks.append(t)
            r.keys.append(r.key_at(start + i, t))
        self.write(h, res.slots.tolist(), start)

    # ----- rules
    @precondition(lambda self: len(self.reqs) < MAX_REQ)
    @rule(data=st.data(), salt=st.sampled_from([0, 0, 2]), prompt=prompts)
    def open_prompt(self, data, salt, prompt):
        self.events()
        dev = len(self.router.longest(salt, prompt[:-1]))
        hs, cached = self.p.open_with_prefix(prompt, [len(prompt)], salt=salt)
        h, c = int(hs[0]), int(cached[0])
        assert c <= len(self.router.longest(salt, prompt[:-1], also=self.host_router))
        if not self.host and not (c < dev and any((salt, tuple(prompt[:e])) in self.router.removed
                                                  for e in range(1, dev + 1))):
            assert c == dev  # short only past a removed ancestor not recomputed since (orphans)
        self.reqs[h] = Req.hit(salt, prompt, c)
        # Mostly the whole prompt, then published: later prompts have something to hit.
        n = len(prompt) - c if data.draw(st.integers(0, 3)) else data.draw(st.integers(0, len(prompt) - c))
        self.extend_by(h, n, data.draw(st.booleans()))
        if data.draw(st.booleans()) and self.p.length(h) == len(prompt):
            self.p.cache([h])

    @precondition(lambda self: set(self.reqs) - self.swapped)
    @rule(data=st.data(), n=st.integers(1, 4), with_tokens=st.booleans())
    def extend(self, data, n, with_tokens):
        self.extend_by(self.on_device(data), n, with_tokens)

    @precondition(lambda self: set(self.reqs) - self.swapped)
    @rule(data=st.data())
    def cache(self, data):
        self.p.cache([self.on_device(data)])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), cache=st.booleans())
    def close(self, data, cache):
        h = data.draw(st.sampled_from(sorted(self.reqs)))
        cache = cache and h not in self.swapped
        self.p.close([h], cache=cache)
        del self.reqs[h]
        self.swapped.discard(h)

    @precondition(lambda self: (set(self.reqs) - self.swapped) and len(self.reqs) < MAX_REQ)
    @rule(data=st.data())
    def fork(self, data):
        h = self.on_device(data)
        for k in self.p.fork(h, 1).tolist():
            self.reqs[int(k)] = self.reqs[h].copy()

    @precondition(lambda self: set(self.reqs) - self.swapped)
    @rule(data=st.data())
    def truncate(self, data):
        h = self.on_device(data)
        r = self.reqs[h]
        n = data.draw(st.integers(0, len(r.keys)))
        self.p.truncate([h], [n])
        if n < len(r.keys):
            del r.prompt[n:]
        del r.keys[n:], r.toks[n:]

    @rule(n=st.integers(0, 5))
    def evict(self, n):
        self.p.evict(n)

    @rule()
    def clear_cache(self):
        self.p.clear_cache()

    @precondition(lambda self: self.host and set(self.reqs) - self.swapped)
    @rule(data=st.data())
    def swap_out(self, data):
        h = self.on_device(data)
        try:
            self.p.swap_out([h])
        except kvpool.PoolExhaustedError:
            return
        self.swapped.add(h)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        h = data.draw(st.sampled_from(sorted(self.swapped)))
        try:
            self.p.swap_in([h])
        except kvpool.PoolExhaustedError:
            return
        self.swapped.discard(h)

    # ----- invariants
    @invariant()
    def reads_back(self):
        if not hasattr(self, "p"):
            return
        p = self.p
        p.check()
        self.events()
        for h, r in self.reqs.items():
            assert p.length(h) == len(r.keys)
            if h in self.swapped:
                continue
            slots = p.slots(h)
            row = int(p.rows([h])[0])
            assert p.req_to_token[row, :len(slots)].tolist() == slots.tolist()
            if not len(slots):
                continue
            want = self.rows_for(r.keys)
            for layer in range(LAYERS):
                k, v = p.read(layer, slots)
                assert torch.equal(k, want + 1000 * layer), f"request {h} layer {layer} K differs"
                assert torch.equal(v, -want - 1000 * layer)
        stats = p.stats()
        assert stats.cached_pages == len(self.router.entries)
        assert stats.host_cached_pages == len(self.host_router.entries)
        for page, key in self.router.entries.values():
            k, _ = p.read(0, np.array([page]))
            assert float(k[0, 0, 0]) == self.val(key), f"cached page {page} holds other K/V"


PoolMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestPage1Pool = PoolMachine.TestCase


def test_page1_and_page2_agree_on_hits_when_nothing_is_evicted():
    """The same trace on roomy pools: page 1 hits every cached token (one short of
    the prompt), page 2 the same rounded down to its page."""
    pools = {ps: kvpool.SlotAllocator(64, ps, 8, 32, hash_seed=5) for ps in (1, 2)}
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 3, 4, 5, 6, 7], [1, 2], [7]]
    for prompt in prompts:
        got = {}
        for ps, a in pools.items():
            hs, cached = a.open_with_prefix(prompt, [len(prompt)])
            got[ps] = int(cached[0])
            a.extend(hs, [len(prompt) - got[ps]])
            a.close(hs, cache=True)
        assert got[2] == got[1] - got[1] % 2, (prompt, got)
    assert [int(pools[1].open_with_prefix(q, [len(q)])[1][0]) for q in prompts] == [4, 3, 6, 1, 0]


@pytest.mark.parametrize("ps", [1, 2])
def test_refusals_leave_the_pool_as_it_was(ps):
    from review_page1_refs import snapshot
    a = kvpool.SlotAllocator(6, ps, 3, 8, hash_seed=1)
    hs, _ = a.open_with_prefix([1, 2, 3], [3])
    a.extend(hs, [3])
    a.cache(hs)
    kid = int(a.fork(int(hs[0]), 1)[0])
    live = [int(hs[0]), kid]
    before = snapshot(a, live), a.take_events()
    assert len(before[1]["kind"])  # the Stored events; drained so the backlog compares empty
    before = snapshot(a, live)
    calls = [lambda: a.extend(live, [1, 1], tokens=[1]), lambda: a.extend(live, [100, 1]),
             lambda: a.extend(live, [-1, 1]), lambda: a.truncate(live, [4, 0]), lambda: a.fork(kid, 5),
             lambda: a.open_with_prefix([1, 2], [3]), lambda: a.open_with_prefix([1, -2], [2]),
             lambda: a.open_with_prefix([1, 2], [2], salt=[1, 2]), lambda: a.cache([kid, kid]),
             lambda: a.close([kid], priority=5), lambda: a.evict(-1), lambda: a.swap_out(live),
             lambda: a.extend(live, [ps * 5, ps * 5]), lambda: a.close([kid, int(hs[0]) + (1 << 32)])]
    for call in calls:
        with pytest.raises(kvpool.KVPoolError):
            call()
        assert snapshot(a, live) == before
        assert len(a.take_events()["kind"]) == 0
        a.check()


@pytest.mark.parametrize("ps, first, second, hit", [(1, [1, 2], [1, 2, 3, 9], 3), (2, [1, 2], [1, 2, 3, 1, 2], 4)])
def test_swap_in_retakes_a_page_still_cached_on_the_device(ps, first, second, hit):
    """swap_in re-takes the device copy swap_out left CACHED (it used to load a fresh page and, on a
    full device, evict that copy for it): no load, and a later prompt still hits."""
    a = kvpool.SlotAllocator(4, ps, 4, 16, hash_seed=1, host_pages=12)
    h, _ = a.open_with_prefix(first, [len(first)])
    a.extend(h, [len(first)])
    a.close(h, cache=True)
    h, cached = a.open_with_prefix(second, [len(second)])
    assert int(cached[0]) == len(first)
    a.extend(h, [len(second) - len(first) - (ps == 1)])  # every device page held: none free
    assert a.free_pages == 0
    a.swap_out(h)
    a.take_offloads()
    a.swap_in(h)
    _, dst = a.take_loads()
    a.cache(h)
    # The prefix's own pages were still on the device: a second reader needs no new page.
    _, again = a.open_with_prefix(second, [len(second)])
    assert (int(again[0]), len(dst)) == (hit, a.pages(h[0]).size - len(first) // ps)


@pytest.mark.parametrize("ps", [1, 2])
def test_duplicate_tip_evicted_restarts_the_chain(ps):
    """A chain whose tip was a duplicate's entry restarts when that entry is evicted (it used
    to stop publishing for good): the request's later pages are registered and hit."""
    a = kvpool.SlotAllocator(16, ps, 4, 32, hash_seed=1)
    prompt = list(range(1, 3 * ps + 1))
    first, _ = a.open_with_prefix(prompt, [len(prompt)])
    a.extend(first, [len(prompt)])
    a.cache(first)
    second, cached = a.open_with_prefix(prompt, [len(prompt)])  # all cached: the last page is recomputed
    assert int(cached[0]) == len(prompt) - ps
    a.extend(second, [ps])
    a.cache(second)  # a duplicate of first's last page, which first still holds
    a.close(first)
    assert a.evict(1) == 1  # first's last page: the chain's tail
    a.extend(second, [2 * ps], tokens=list(range(50, 50 + 2 * ps)))
    a.close(second, cache=True)
    # second computed and published prompt + 2 pages; a prompt over all of it hits all of it
    full = prompt + list(range(50, 50 + 2 * ps))
    _, again = a.open_with_prefix(full + [7], [len(full) + 1])
    assert int(again[0]) == len(full)


def test_orphan_child_served_once_its_parent_is_recomputed():
    """The root, evicted first at a lower priority, leaves its children orphans (their Stored
    events stand); recomputing it revives its registration (prefix/ghosts.rs), so the chain the
    events advertise is the chain a lookup serves."""
    a = kvpool.SlotAllocator(8, 1, 4, 16, hash_seed=7, max_pinned_pages=1)
    router = Router(1)
    h, _ = a.open_with_prefix([3, 1, 2], [3])
    a.extend(h, [3])
    a.cache(h, priority=100)  # one pin allowed: the root gets 100, the rest 99
    assert a.unpin(h) == 1
    a.close(h)
    assert a.evict(1) == 1  # the root: the lowest priority goes first
    g, _ = a.open_with_prefix([3, 1], [2])
    a.extend(g, [2])
    a.close(g, cache=True)
    router.feed(a.take_events())
    assert len(router.longest(0, [3, 1, 2])) == 3  # what a KV-aware router now believes
    _, cached = a.open_with_prefix([3, 1, 2, 1], [4])
    assert int(cached[0]) == 3
