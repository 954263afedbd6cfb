"""Data integrity of the host tier (and the disk tier over it) under engine-like sequences.

The reference model: K/V at position i of a request is a pure function of (salt, the
request's tokens 0..i, layer), as in a real model, so a hit on a page whose own tokens
match but whose parent differs, a stale page after truncate and rewrite, or a page
filled by the wrong transfer all read back wrong. hypothesis draws each operation
(batched prefix opens, decode, cache, close, swap_out / swap_in, fork, truncate and
rewrite, evict, clear_cache, chain-hash opens, disk store / prefetch) on small pools so
that device pressure offloads and host pressure evicts. After every step every live,
resident request reads back its K/V in every layer, the pool's check passes and no
transfer is left queued; after everything closes and the cache is cleared, no device
or host page is left used.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpool
from kvpool.tiers import DiskCache, FileTier

H, D, LAYERS, CTX = 2, 4, 2, 40
REFUSED = (kvpool.PoolExhaustedError, kvpool.TooManyRequestsError, kvpool.ContextTooLongError)
# A common head, then branches; the third and fourth repeat branch A's tokens under another
# head (or a shorter one), so whole pages with equal token ids sit under different parents.
HEAD = [5, 6, 7, 8, 9, 10, 11, 12]
BRANCH_A = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
BASES = [HEAD + BRANCH_A, HEAD + [40, 41, 42, 43, 44, 45, 46, 47], [90, 91, 92, 93, 94, 95, 96, 97] + BRANCH_A,
         HEAD[:4] + BRANCH_A]
MASK = (1 << 64) - 1


def expected(tokens, salt, layer):
    """K and V of every position: nibbles of a rolling hash of the whole prefix."""
    h, ks, vs = (salt * 0x9E3779B97F4A7C15 + layer * 0xBF58476D1CE4E5B9) & MASK, [], []
    for t in tokens:
        h = ((h ^ (int(t) + 1)) * 0x94D049BB133111EB + 0x632BE59B) & MASK
        ks.append([(h >> (4 * j)) & 15 for j in range(H * D)])
        vs.append([(h >> (4 * j + 32)) & 15 for j in range(H * D)])
    k = torch.tensor(ks, dtype=torch.float32).reshape(-1, H, D)
    v = torch.tensor(vs, dtype=torch.float32).reshape(-1, H, D)
    return k, v


class Model:
    def __init__(self, data, page_size, num_pages, host_pages, policy, tmp, layout="token", device_table=False):
        self.data, self.ps, self.tmp = data, page_size, tmp
        self.args = dict(dtype=torch.float16, page_size=page_size, num_pages=num_pages, max_requests=6,
                         max_context_len=CTX, host_pages=host_pages, host_policy=policy, layout=layout)
        self.device_table = device_table
        self.new_pool(3)
        self.reqs: dict[int, list] = {}  # handle -> [tokens held, salt, prompt still to follow]
        self.swapped: set[int] = set()
        self.log: list[str] = []

    def new_pool(self, seed):
        self.pool = kvpool.KVPool(LAYERS, H, D, hash_seed=seed, **self.args)
        if self.device_table:  # req_to_token updated as a CUDA pool updates it (packed update, table kernel)
            self.pool._table_np = None
        self.disk = DiskCache(self.pool, FileTier(self.tmp, 1 << 20), model="m") if self.tmp is not None else None

    def draw(self, strat):
        return self.data.draw(strat)

    def resident(self):
        return [h for h in self.reqs if h not in self.swapped]

    def some(self, hs, most=3):
        return self.draw(st.lists(st.sampled_from(sorted(hs)), min_size=1, max_size=most, unique=True))

    def write(self, h, slots, start):
        tokens, salt, _ = self.reqs[h]
        for layer in range(LAYERS):
            k, v = expected(tokens, salt, layer)
            self.pool.write(layer, torch.as_tensor(slots), k[start:].half(), v[start:].half())

    def verify(self, h):
        tokens, salt, _ = self.reqs[h]
        assert self.pool.length(h) == len(tokens)
        known = self.pool.known_tokens(h).tolist()[: len(tokens)]
        assert known == tokens[: len(known)], "the pool's token ids are not what was written"
        if h in self.swapped or not tokens:
            return
        pool, n = self.pool, len(tokens)
        # What the engine's kernels read: the request's req_to_token row and its page table.
        slots = pool.req_to_token[int(pool.rows([h])[0]), :n].to(torch.int64)
        assert slots.tolist() == pool.slots(h).tolist()
        pt = pool.page_table([h])
        pages = pt.kv_indices[int(pt.kv_indptr[0]) : int(pt.kv_indptr[1])].to(torch.int64)
        assert (pages.repeat_interleave(self.ps)[:n] * self.ps + torch.arange(n) % self.ps).tolist() == slots.tolist()
        for layer in range(LAYERS):
            k, v = self.pool.read(layer, slots)
            wk, wv = expected(tokens, salt, layer)
            bad = [i for i in range(len(tokens)) if not (torch.equal(k[i].float(), wk[i])
                                                          and torch.equal(v[i].float(), wv[i]))]
            assert not bad, f"request {h:#x} layer {layer}: wrong K/V at positions {bad}\n" + "\n".join(self.log)

    def next_tokens(self, h, n):
        tokens, _, prompt = self.reqs[h]
        at = len(tokens)
        return [prompt[p] if p < len(prompt) else self.draw(st.sampled_from([1, 2, 3, 20, 21]))
                for p in range(at, at + n)]

    def extend(self, hs, counts):
        # Without tokens the prompts say which tokens these are, and past a prompt they are
        # unknown to the pool (never cached): the model gives them ids no prompt has.
        known = self.draw(st.booleans())
        toks = [t if known or p < len(self.reqs[h][2]) else 10_000 + t
                for h, c in zip(hs, counts) for p, t in enumerate(self.next_tokens(h, c), len(self.reqs[h][0]))]
        r = self.pool.extend(hs, counts, tokens=toks) if known else self.pool.extend(hs, counts)
        j = 0
        for h, c in zip(hs, counts):
            start = len(self.reqs[h][0])
            self.reqs[h][0] = self.reqs[h][0] + toks[j : j + c]
            self.write(h, r.slots[j : j + c], start)
            j += c

    # ----- operations ---------------------------------------------------------

    def op_open(self):
        prompts = self.draw(st.lists(st.tuples(st.sampled_from(range(len(BASES))), st.integers(2, 20)),
                                     min_size=1, max_size=3))
        salt = self.draw(st.sampled_from([0, 0, 7]))
        toks = [BASES[b][:n] for b, n in prompts]
        if self.disk is not None and self.draw(st.booleans()):
            for t in toks:
                self.disk.prefetch(t, salt)
        hs, cached = self.pool.open_with_prefix([t for p in toks for t in p], [len(p) for p in toks], salt=salt)
        hs = [int(h) for h in hs]
        for h, t, c in zip(hs, toks, cached.tolist()):
            self.reqs[h] = [t[:c], salt, t]
            self.verify(h)  # what the hit serves is what was written for these tokens
        try:
            self.extend(hs, [len(t) - c for t, c in zip(toks, cached.tolist())])
        except REFUSED:
            self.pool.close(hs)
            for h in hs:
                del self.reqs[h]

    def op_admit(self):
        counts = self.draw(st.lists(st.integers(0, 6), min_size=1, max_size=2))
        toks = self.draw(st.lists(st.sampled_from([1, 2, 3, 20, 21]), min_size=sum(counts), max_size=sum(counts)))
        hs, r = self.pool.admit(counts, tokens=toks)
        j = 0
        for h, c in zip(hs.tolist(), counts):
            self.reqs[h] = [toks[j : j + c], 0, []]
            self.write(h, r.slots[j : j + c], 0)
            j += c

    def op_decode(self):
        if self.resident():
            hs = self.some(self.resident())
            self.extend(hs, [self.draw(st.integers(1, 4)) for _ in hs])

    def op_cache(self):
        if self.resident():
            self.pool.cache(self.some(self.resident()), priority=self.draw(st.sampled_from([None, 0, 100])))

    def op_reset(self):
        self.pool.reset()  # swapped-out requests' host pages come back too
        self.reqs.clear()
        self.swapped.clear()

    def op_close(self):
        if self.reqs:
            h = self.draw(st.sampled_from(sorted(self.reqs)))
            self.pool.close([h], cache=h not in self.swapped and self.draw(st.booleans()))
            del self.reqs[h]
            self.swapped.discard(h)

    def op_swap_out(self):
        if self.resident():
            hs = self.some(self.resident())
            self.pool.swap_out(hs)
            self.swapped.update(hs)

    def op_swap_in(self):
        if self.swapped:
            hs = self.some(self.swapped)
            self.pool.swap_in(hs)
            self.swapped.difference_update(hs)

    def op_fork(self):
        if self.resident():
            h = self.draw(st.sampled_from(sorted(self.resident())))
            for kid in self.pool.fork(h, self.draw(st.integers(1, 2))).tolist():
                tokens, salt, prompt = self.reqs[h]
                self.reqs[kid] = [list(tokens), salt, list(prompt)]

    def op_truncate(self):
        """Truncate, then write other tokens where the old ones were."""
        if self.resident():
            h = self.draw(st.sampled_from(sorted(self.resident())))
            n = self.draw(st.integers(0, len(self.reqs[h][0])))
            self.pool.truncate([h], [n])
            if n < len(self.reqs[h][0]):
                self.reqs[h][2] = self.reqs[h][2][:n]
            self.reqs[h][0] = self.reqs[h][0][:n]
            if self.draw(st.booleans()):
                self.extend([h], [self.draw(st.integers(1, 5))])

    def op_chain(self):
        if self.reqs:
            src = self.draw(st.sampled_from(sorted(self.reqs)))  # swapped out too: its pages' ids are on the host
            hashes, tokens, salt = self.pool.chain_hashes(src)
            assert tokens.tolist() == self.reqs[src][0][: len(tokens)] and 2 * (len(tokens) // self.ps) == len(hashes)
            known = len(self.pool.known_tokens(src))
            assert len(tokens) == min(known, len(self.reqs[src][0])) // self.ps * self.ps
            h = self.pool.open_with_chain_hashes(hashes, tokens, salt)
            n = self.pool.length(h)
            self.reqs[h] = [tokens[:n].tolist(), int(salt), tokens.tolist()]

    def op_evict(self):
        self.pool.evict(self.draw(st.sampled_from([1, 2, 4, 1000])))

    def op_restart(self):
        """Another process: a new pool (another hash seed) on the same disk."""
        if self.disk is not None:
            self.disk.store_new()
            self.finish()
            self.reqs.clear()
            self.swapped.clear()
            self.new_pool(self.draw(st.integers(4, 6)))

    def op_clear(self):
        self.pool.clear_cache()

    def op_store(self):
        if self.disk is not None:
            self.disk.store_new()

    OPS = ["open"] * 4 + ["decode"] * 3 + ["cache", "cache", "close", "close", "swap_out", "swap_out", "swap_in",
                                           "swap_in", "fork", "truncate", "chain", "evict", "store", "admit", "restart"]

    def step(self):
        kind = self.draw(st.sampled_from(self.OPS + ["clear", "reset"] * (len(self.log) % 16 == 15)))
        self.log.append(kind)
        try:
            getattr(self, "op_" + kind)()
        except REFUSED:
            self.log[-1] += " (refused)"
        self.pool.check()
        a = self.pool.allocator
        assert (a.pending_offloads, a.pending_loads, a.pending_copies) == (0, 0, 0)
        for h in self.reqs:
            self.verify(h)
        # Host pages are held only by swapped-out requests (queued transfers are drained),
        # at most one per page of theirs; the rest is FREE or CACHED.
        held = self.pool.host_pages - 1 - self.pool.host_free_pages
        assert 0 <= held <= sum(-(-len(self.reqs[h][0]) // self.ps) for h in self.swapped)
        assert self.pool.host_cached_pages <= self.pool.host_pages - 1

    def finish(self):
        pool = self.pool
        if self.reqs:
            pool.close(sorted(self.reqs))
        pool.clear_cache()
        pool.check()
        assert (pool.used_pages, pool.open_requests, pool.cached_pages) == (0, 0, 0)
        assert pool.free_pages == pool.capacity_pages
        assert (pool.host_free_pages, pool.host_cached_pages) == (pool.host_pages - 1, 0)


@given(data=st.data())
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
def test_tier_sequences_read_back_what_was_written(tmp_path_factory, data):
    """One example: a geometry, a policy, a layout, the CPU or the device table path,
    with or without a disk tier, and up to 40 operations."""
    page_size = data.draw(st.sampled_from([1, 2, 3, 4]), label="page_size")
    num_pages = data.draw(st.integers(4, 40 // page_size + 2), label="num_pages")
    host_pages = data.draw(st.integers(2, 24 // page_size + 3), label="host_pages")
    policy = data.draw(st.sampled_from(["write_back", "write_through"]), label="policy")
    layout = data.draw(st.sampled_from(["token", "paged"]), label="layout")
    device_table = data.draw(st.booleans(), label="device_table")
    tmp = tmp_path_factory.mktemp("disk") if data.draw(st.booleans(), label="disk") else None
    m = Model(data, page_size, num_pages, host_pages, policy, tmp, layout=layout, device_table=device_table)
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        m.step()
    m.finish()


def _pool(policy, **kw):
    args = dict(dtype=torch.float16, page_size=4, num_pages=8, max_requests=4, max_context_len=CTX, host_pages=12,
                host_policy=policy, hash_seed=1)
    return kvpool.KVPool(LAYERS, H, D, **{**args, **kw})


def _fill(pool, tokens, h=None, start=0):
    if h is None:
        hs, cached = pool.open_with_prefix(tokens, [len(tokens)])
        h, start = int(hs[0]), int(cached[0])
    slots = pool.extend([h], [len(tokens) - start], tokens=tokens[start:]).slots
    for layer in range(LAYERS):
        k, v = expected(tokens, 0, layer)
        pool.write(layer, torch.as_tensor(slots), k[start:].half(), v[start:].half())
    return h


def _reads(pool, h, tokens):
    slots = pool.slots(h)
    assert len(slots) == len(tokens)
    for layer in range(LAYERS):
        k, v = pool.read(layer, slots)
        wk, wv = expected(tokens, 0, layer)
        assert torch.equal(k.float(), wk) and torch.equal(v.float(), wv), f"layer {layer}: wrong K/V"


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_a_cached_page_cut_back_swapped_and_loaded_is_rewritten_not_shared(policy):
    """Cut back into a registered page, swapped out, the device copy evicted: swap_in
    makes the loaded page the entry's device copy, so the rewrite must drop it (or copy)
    rather than change what later prompts of the old tokens hit."""
    pool = _pool(policy)
    old = list(range(1, 10))
    h = _fill(pool, old)
    pool.cache([h])
    pool.truncate([h], [6])
    pool.swap_out([h])
    pool.evict(100)
    pool.swap_in([h])
    new = old[:6] + [50, 51, 52]
    _fill(pool, new, h, 6)
    _reads(pool, h, new)
    hs, cached = pool.open_with_prefix(old, [len(old)])
    assert int(cached[0]) == 8
    _reads(pool, int(hs[0]), old[:8])
    pool.check()


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_equal_pages_under_other_parents_come_back_from_the_host_as_their_own(policy):
    """Pages with equal token ids under different first pages, both only on the host:
    each prompt hits its own chain's K/V."""
    pool = _pool(policy)
    a, c = [5, 6, 7, 8] + BRANCH_A[:8] + [1], [90, 91, 92, 93] + BRANCH_A[:8] + [1]
    for tokens in (a, c):
        pool.close([_fill(pool, tokens)], cache=True)
    pool.evict(100)
    assert pool.cached_pages == 0 and pool.host_cached_pages == 6
    for tokens in (c, a):
        hs, cached = pool.open_with_prefix(tokens, [len(tokens)])
        assert int(cached[0]) == 12
        _reads(pool, int(hs[0]), tokens[:12])
    assert pool.host_hit_tokens == 24
    pool.check()
