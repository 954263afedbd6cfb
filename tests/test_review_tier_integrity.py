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

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpool
from kvpool.tiers import DiskCache, FileTier

H, D, LAYERS, CTX = 2, 4, 2, 40
REFUSED = (kvpool.PoolExhaustedError, kvpool.TooManyRequestsError, kvpool.ContextTooLongError)
# A common head, then branches; "tail" repeats branch a's later tokens under another head,
# so whole pages with equal token ids sit under different parents.
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
        toks = [t for h, c in zip(hs, counts) for t in self.next_tokens(h, c)]
        if all(len(self.reqs[h][0]) + c <= len(self.reqs[h][2]) for h, c in zip(hs, counts)) and self.draw(st.booleans()):
            r = self.pool.extend(hs, counts)  # the prompts say which tokens these are
        else:
            r = self.pool.extend(hs, counts, tokens=toks)
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
            self.pool.cache(self.some(self.resident()))

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
            assert len(tokens) == len(self.reqs[src][0]) // self.ps * self.ps
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
        kind = self.draw(st.sampled_from(self.OPS + ["clear"] * (len(self.log) % 16 == 15)))
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

    def finish(self):
        pool = self.pool
        if self.reqs:
            pool.close(sorted(self.reqs))
        pool.clear_cache()
        pool.check()
        assert (pool.used_pages, pool.open_requests, pool.cached_pages) == (0, 0, 0)
        assert pool.free_pages == pool.capacity_pages
        assert (pool.host_free_pages, pool.host_cached_pages) == (pool.host_pages - 1, 0)


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def run(data, page_size, policy, tmp=None, **kw):
    num_pages = data.draw(st.integers(4, 40 // page_size + 2), label="num_pages")
    host_pages = data.draw(st.integers(2, 24 // page_size + 3), label="host_pages")
    m = Model(data, page_size, num_pages, host_pages, policy, tmp, **kw)
    for _ in range(data.draw(st.integers(1, 60), label="steps")):
        m.step()
    m.finish()


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@given(data=st.data())
@SETTINGS
def test_host_tier_sequences_read_back_what_was_written(page_size, policy, data):
    run(data, page_size, policy)


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@given(data=st.data())
@settings(SETTINGS, max_examples=60)
def test_disk_tier_over_host_tier_sequences(tmp_path_factory, policy, data):
    run(data, 2, policy, tmp_path_factory.mktemp("disk"))


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@given(data=st.data())
@settings(SETTINGS, max_examples=60)
def test_paged_layout_on_the_device_table_path(policy, data):
    run(data, 4, policy, layout="paged", device_table=True)
