"""Outside-style check of a KVPool with a host tier: random (hypothesis) sequences of
open_with_prefix (fresh prompts and re-hits of published ones) / extend / write / cache /
close(cache=True) / fork / truncate / swap_out / swap_in / evict at page size 1 and 16, under write_back and write_through.

Every write stores K/V that depend on the request's whole prefix and salt
(``_outside_host_tier.prefix_values``), so after every step every live request reads
back, through ``pool.read`` at its ``slots`` and its ``req_to_token`` row, bitwise what
its tokens say: a host hit that loaded another chain's page (same tokens, other parent
or salt), a swap_in that brought back another page, or a copy-on-write that did not run
would all read other bytes. A refused step (no room) leaves the pool as it was.
"""

from __future__ import annotations

import pytest
import torch
from _outside_host_tier import LAYERS, D, H, assert_holds, no_events, prefix_values, state, write_positions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpool

# Few bases and a tiny vocabulary: prompts share prefixes (device and host hits), and
# equal pages sit under different parents.
BASES = [[1, 2, 3, 1] * 8, [1, 2, 3, 2] * 8, [3, 1, 2, 1] * 8]
VOCAB = [1, 2, 3]
REFUSED = (kvpool.PoolExhaustedError, kvpool.TooManyRequestsError, kvpool.ContextTooLongError)
CTX = 64


def make_pool(page_size, policy):
    # Few device pages (pressure evicts and, under write_back, offloads), more host pages.
    num_pages = 6 if page_size == 16 else 80
    host_pages = 12 if page_size == 16 else 160
    return kvpool.KVPool(LAYERS, H, D, dtype=torch.float32, page_size=page_size, num_pages=num_pages,
                         max_requests=6, max_context_len=CTX, host_pages=host_pages, host_policy=policy,
                         hash_seed=11)


class Run:
    def __init__(self, data, page_size, policy):
        self.draw = data.draw
        self.pool = make_pool(page_size, policy)
        self.reqs = {}  # handle -> [tokens, salt]
        self.swapped = set()
        self.ops = []
        self.published = []  # (prompt, salt) of requests cache()d or closed with cache=True

    def resident(self):
        return sorted(h for h in self.reqs if h not in self.swapped)

    def some(self, hs):
        return self.draw(st.lists(st.sampled_from(hs), min_size=1, max_size=min(3, len(hs)), unique=True))

    def op_new(self, again=False):
        if again:  # a prompt published before, maybe evicted to the host since, one token on
            prompt, salt = self.draw(st.sampled_from(self.published))
            prompt = prompt + [self.draw(st.sampled_from(VOCAB))]
        else:
            base = self.draw(st.sampled_from(range(len(BASES))))
            cut = self.draw(st.integers(1, 40))
            tail = self.draw(st.lists(st.sampled_from(VOCAB), max_size=6))
            prompt = BASES[base][:cut] + tail
            salt = self.draw(st.sampled_from([0, 0, 9]))
        prompt = prompt[:CTX - 8]
        hs, cached = self.pool.open_with_prefix(prompt, [len(prompt)], salt)
        h, c = int(hs[0]), int(cached[0])
        assert 0 <= c < len(prompt)
        try:
            r = self.pool.extend([h], [len(prompt) - c])
        except REFUSED:
            self.pool.close([h])
            raise
        self.reqs[h] = [list(prompt), salt]
        # A prefix hit (device or host) already holds the prompt's first c positions' K/V.
        slots = self.pool.slots(h)
        if c:
            assert_holds_prefix(self.pool, h, prompt, salt, c)
        write_positions(self.pool, r.slots, prompt, salt, c)
        assert slots[c:].tolist() == r.slots.tolist()

    def op_decode(self):
        hs = self.some(self.resident())
        toks = {h: self.draw(st.lists(st.sampled_from(VOCAB), min_size=1, max_size=3)) for h in hs}
        if any(len(self.reqs[h][0]) + len(toks[h]) > CTX for h in hs):
            return
        flat = [t for h in hs for t in toks[h]]
        r = self.pool.extend(hs, [len(toks[h]) for h in hs], flat)
        at = 0
        for h in hs:
            old = len(self.reqs[h][0])
            self.reqs[h][0] += toks[h]
            n = len(toks[h])
            write_positions(self.pool, r.slots[at:at + n], self.reqs[h][0], self.reqs[h][1], old)
            at += n

    def op_again(self):
        if self.draw(st.booleans()):  # (push the cached pages out first: the hit, if any, is the host's)
            self.pool.evict(self.pool.num_pages)
        self.op_new(again=True)

    def op_cache(self):
        hs = self.some(self.resident())
        self.pool.cache(hs)
        self.published += [(list(self.reqs[h][0]), self.reqs[h][1]) for h in hs]

    def op_close(self):
        hs = self.some(sorted(self.reqs))
        cache = not (set(hs) & self.swapped) and self.draw(st.booleans())
        self.pool.close(hs, cache=cache)
        if cache:
            self.published += [(list(self.reqs[h][0]), self.reqs[h][1]) for h in hs]
        for h in hs:
            self.reqs.pop(h)
            self.swapped.discard(h)

    def op_fork(self):
        h = self.draw(st.sampled_from(self.resident()))
        (child,) = self.pool.fork(h, 1)
        self.reqs[int(child)] = [list(self.reqs[h][0]), self.reqs[h][1]]

    def op_swap_out(self):
        hs = self.some(self.resident())
        self.pool.swap_out(hs)
        self.swapped |= set(hs)

    def op_swap_in(self):
        hs = self.some(sorted(self.swapped))
        self.pool.swap_in(hs)
        self.swapped -= set(hs)

    def op_evict(self):
        self.pool.evict(self.draw(st.integers(0, self.pool.num_pages)))

    def op_truncate(self):
        h = self.draw(st.sampled_from(self.resident()))
        n = self.draw(st.integers(1, len(self.reqs[h][0])))
        self.pool.truncate([h], [n])
        del self.reqs[h][0][n:]

    def step(self):
        kinds = ["new", "evict"]
        if self.resident():
            kinds += ["decode", "cache", "fork", "swap_out", "truncate"]
        if self.reqs:
            kinds += ["close"]
        if self.swapped:
            kinds += ["swap_in", "swap_in"]
        if self.published:
            kinds += ["again", "again"]
        kind = self.draw(st.sampled_from(kinds))
        handles = sorted(self.reqs)
        self.pool.take_events()
        before = state(self.pool, handles)
        try:
            getattr(self, "op_" + kind)()
        except REFUSED:
            # (new and again open, then close what their extend could not fill: counters move)
            if kind not in ("new", "again"):
                assert state(self.pool, handles) == before, f"a refused {kind} changed the pool"
                assert no_events(self.pool.take_events())
            self.ops.append(kind + "!")
        else:
            self.ops.append(kind)
        self.pool.check()
        a = self.pool.allocator
        assert (a.pending_offloads, a.pending_loads, a.pending_copies) == (0, 0, 0)
        for h, (tokens, salt) in self.reqs.items():
            assert self.pool.length(h) == len(tokens)
            assert self.pool.known_tokens(h).tolist() == tokens
            if h not in self.swapped:
                assert_holds(self.pool, h, tokens, salt)


def assert_holds_prefix(pool, h, prompt, salt, cached):
    """After a hit, before anything is written: the hit positions hold the prefix's K/V."""
    idx = torch.as_tensor(pool.slots(h)[:cached])
    for layer in range(LAYERS):
        k, v = prefix_values(prompt[:cached], salt, layer)
        rk, rv = pool.read(layer, idx)
        assert torch.equal(rk, k) and torch.equal(rv, v), f"a hit of {cached} tokens loaded other bytes (layer {layer})"


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_every_live_request_reads_back_its_own_prefix_kv(page_size, policy):
    seen = {"offloaded": 0, "loaded": 0, "host_hits": 0, "swap_in": 0}

    @settings(max_examples=25, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def sequences(data):
        run = Run(data, page_size, policy)
        for _ in range(data.draw(st.integers(10, 40))):
            run.step()
        a = run.pool.allocator
        seen["offloaded"] += a.offloaded_pages
        seen["loaded"] += a.loaded_pages
        seen["host_hits"] += a.host_hit_tokens
        seen["swap_in"] += run.ops.count("swap_in")
        run.pool.reset()
        run.pool.check()
        assert run.pool.open_requests == 0 and run.pool.host_free_pages == run.pool.host_pages - 1

    sequences()
    # Not vacuous: pages went to the host and came back, and prompts hit host copies.
    assert seen["offloaded"] > 0 and seen["loaded"] > 0 and seen["swap_in"] > 0, seen
    assert seen["host_hits"] > 0, seen
