"""Seeded random sequences on a KVPool with a host tier, against a plain model of which
tokens each request holds.

A request's K/V at position i depend only on (token i, i, salt), so any position read
through ``slots``/``read`` must hold exactly what its tokens say, whichever request wrote
it: after prefix hits (device or host), swap_out -> other requests reuse the pages ->
swap_in, fork and copy-on-write, truncate, eviction under pressure, clear_cache and
reset. Every call runs under a random grad mode on a pool built under inference_mode;
every refused call (no room, no row, and a bad argument of every kind) leaves the pool
bitwise as it was: counters, each request's slots and known tokens, priorities and
every tensor the pool owns (the host tier's included). Page sizes 1 and 16, token and
paged layouts, fp16 / bf16 / fp32 / fp8, write_back and write_through.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

import kvpool

H, D, LAYERS, CTX = 2, 4, 2, 96
MODES = (torch.no_grad, torch.inference_mode, torch.enable_grad)
REFUSED = (kvpool.PoolExhaustedError, kvpool.TooManyRequestsError, kvpool.ContextTooLongError)


def kv(tokens, start, salt, layer, dtype):
    """K and V rows of positions start.. : small integers, exact in every dtype (fp8 too)."""
    t = torch.tensor(tokens[start:], dtype=torch.int64)
    i = torch.arange(start, len(tokens))
    d = torch.arange(D)
    h0 = (t * 7 + i * 13 + salt * 3 + layer * 5).view(-1, 1) + d
    h1 = (t * 11 + i * 5 + salt + layer).view(-1, 1) + 3 * d
    k = torch.stack([h0 % 16, h1 % 16], dim=1).to(torch.float32)
    return k.to(dtype), (-k).to(dtype)


def snapshot(pool, handles):
    s = pool.stats()
    counters = [getattr(s, f) for f in dir(s) if not f.startswith("_") and not callable(getattr(s, f))]
    per = []
    for h in handles:
        if not pool.is_open(h):
            per.append(None)
        elif pool.is_swapped(h):
            per.append(("swapped", pool.length(h), pool.known_tokens(h).tolist()))
        else:
            per.append((pool.slots(h).tolist(), pool.known_tokens(h).tolist()))
    tensors = [bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for _, t in pool.named_tensors()]
    return counters, per, tensors, pool.evictable_pages_by_priority().tolist(), pool.pinned_pages


class Run:
    def __init__(self, seed, page_size, layout, dtype, policy):
        self.rng = random.Random(seed)
        self.ps = page_size
        num_pages, host_pages = (48, self.rng.choice([10, 40, 120])) if page_size == 1 else (8, self.rng.choice([4, 12, 40]))
        with torch.inference_mode():
            self.pool = kvpool.KVPool(LAYERS, H, D, dtype=dtype, page_size=page_size, num_pages=num_pages,
                                      max_requests=8, max_context_len=CTX, layout=layout, host_pages=host_pages,
                                      host_policy=policy, hash_seed=seed, manual_clock=True)
        self.reqs: dict[int, list] = {}  # handle -> [tokens held, salt]
        self.prompt: dict[int, list] = {}  # handle -> prompt ids later extends must follow
        self.swapped: set[int] = set()
        self.bases = [[self.rng.randrange(1000) for _ in range(CTX)] for _ in range(3)]
        self.now = 0.0

    # ----- the model's view ---------------------------------------------------

    def write(self, h, slots, start):
        tokens, salt = self.reqs[h]
        for layer in range(LAYERS):
            k, v = kv(tokens, start, salt, layer, self.pool.compute_dtype)
            self.pool.write(layer, torch.as_tensor(slots), k, v)

    def verify(self, h):
        pool = self.pool
        tokens, salt = self.reqs[h]
        assert pool.length(h) == len(tokens)
        assert pool.is_swapped(h) == (h in self.swapped)
        if h in self.swapped:
            return
        slots = pool.slots(h)
        row = int(pool.rows([h])[0])
        assert pool.req_to_token[row, : len(slots)].tolist() == slots.tolist()
        for layer in range(LAYERS):
            k, v = pool.read(layer, slots)
            wk, wv = kv(tokens, 0, salt, layer, pool.compute_dtype)
            assert torch.equal(k, wk) and torch.equal(v, wv), f"request {h:#x} layer {layer}: wrong K/V"

    def resident(self):
        return [h for h in self.reqs if h not in self.swapped]

    def pick(self, hs, most=2):
        return self.rng.sample(hs, self.rng.randint(1, min(most, len(hs))))

    # ----- operations -----------------------------------------------------------

    def op_new(self):
        n = self.rng.randrange(1, CTX // 2)
        prompt, salt = self.rng.choice(self.bases)[:n], self.rng.choice([0, 0, 5])
        hs, cached = self.pool.open_with_prefix(prompt, [n], salt=salt)
        h, c = int(hs[0]), int(cached[0])
        self.reqs[h], self.prompt[h] = [prompt[:c], salt], list(prompt)
        self.verify(h)  # a hit (device or host) reads what the prefix's writer wrote
        try:
            r = self.pool.extend([h], n - c)
        except kvpool.PoolExhaustedError:
            self.pool.close([h])
            del self.reqs[h]
            return
        self.reqs[h][0] = prompt
        self.write(h, r.slots, c)

    def op_decode(self):
        if not self.resident():
            return
        hs = self.pick(self.resident(), 8)
        counts = [self.rng.randint(1, 5) for _ in hs]
        toks = []
        for h, c in zip(hs, counts):
            at, pr = len(self.reqs[h][0]), self.prompt.get(h, [])
            toks += [pr[p] if p < len(pr) else self.rng.randrange(1000) for p in range(at, at + c)]
        r = self.pool.extend(hs, counts, tokens=toks)
        j = 0
        for h, c in zip(hs, counts):
            start = len(self.reqs[h][0])
            self.reqs[h][0] = self.reqs[h][0] + toks[j : j + c]
            self.write(h, r.slots[j : j + c], start)
            j += c

    def op_admit(self):
        counts = [self.rng.randint(0, 12) for _ in range(self.rng.randint(1, 2))]
        toks = [self.rng.randrange(1000) for _ in range(sum(counts))]
        hs, r = self.pool.admit(counts, tokens=toks)
        j = 0
        for h, c in zip(hs.tolist(), counts):
            self.reqs[h] = [toks[j : j + c], 0]
            self.write(h, r.slots[j : j + c], 0)
            j += c

    def op_cache(self):
        if self.resident():
            self.pool.cache(self.pick(self.resident()), priority=self.rng.choice([None, 0, 50, 100]))

    def op_close(self):
        if self.reqs:
            h = self.rng.choice(list(self.reqs))
            self.pool.close([h], cache=h not in self.swapped and self.rng.random() < 0.7)
            del self.reqs[h]
            self.swapped.discard(h)

    def op_swap_out(self):
        if self.resident():
            hs = self.pick(self.resident())
            self.pool.swap_out(hs)
            self.swapped.update(hs)

    def op_swap_in(self):
        if self.swapped:
            hs = self.pick(sorted(self.swapped))
            self.pool.swap_in(hs)
            self.swapped.difference_update(hs)

    def op_fork(self):
        if self.resident():
            h = self.rng.choice(self.resident())
            kid = int(self.pool.fork(h, 1)[0])
            self.reqs[kid], self.prompt[kid] = [list(self.reqs[h][0]), self.reqs[h][1]], list(self.prompt.get(h, []))

    def op_truncate(self):
        if self.resident():
            h = self.rng.choice(self.resident())
            n = self.rng.randint(0, len(self.reqs[h][0]))
            self.pool.truncate([h], [n])
            if n < len(self.reqs[h][0]):  # shortened: the prompt is forgotten from there
                self.prompt[h] = self.prompt.get(h, [])[:n]
            self.reqs[h][0] = self.reqs[h][0][:n]

    def op_chain(self):
        if self.resident():
            hashes, tokens, salt = self.pool.chain_hashes(self.rng.choice(self.resident()))
            pages = self.pool.match_chain_hashes(hashes, tokens, salt)
            h = self.pool.open_with_chain_hashes(hashes, tokens, salt)
            assert self.pool.length(h) == pages * self.ps
            self.reqs[h], self.prompt[h] = [list(tokens[: pages * self.ps]), salt], list(tokens)

    def op_evict(self):
        self.pool.evict(self.rng.randint(0, 4))

    def op_clock(self):
        self.now += self.rng.choice([0.5, 2.0, 10.0])
        self.pool.set_clock(self.now)
        if self.resident():
            self.pool.cache(self.pick(self.resident()), priority=self.rng.randint(0, 100), retain_s=3.0)

    def op_unpin(self):
        if self.resident():
            self.pool.unpin(self.pick(self.resident()))

    def op_clear(self):
        self.pool.clear_cache()

    def op_reset(self):
        self.pool.reset()
        self.reqs.clear()
        self.swapped.clear()

    def op_bad(self):
        """One refused call of each kind, chosen at random: typed, and the pool as it was."""
        pool, res, sw = self.pool, self.resident(), sorted(self.swapped)
        r0 = res[0] if res else None
        s0 = sw[0] if sw else None
        stale = 1 << 40
        calls = [
            lambda: pool.swap_out([r0, r0] if res else [stale]),
            lambda: pool.swap_out([s0] if sw else True),
            lambda: pool.swap_in([r0] if res else [stale]),
            lambda: pool.swap_in(sw + sw[:1] if sw else np.array([1.5])),
            lambda: pool.swap_in(np.array([[s0 or stale]])),
            lambda: pool.swap_out(res + sw[:1] if sw and res else torch.tensor([1.0])),
            lambda: pool.cache(res[:1] or [stale], priority=101),
            lambda: pool.cache(res[:1] or [stale], priority=True),
            lambda: pool.cache(res[:1] or [stale], priority=5, retain_s=np.True_),
            lambda: pool.cache(sw[:1] or [stale]),
            lambda: pool.close(sw[:1] or [stale], cache=True),
            lambda: pool.extend(sw[:1] or [stale], 1),
            lambda: pool.extend(res[:1] or [stale], [-1]),
            lambda: pool.truncate(sw[:1] or [stale], [0]),
            lambda: pool.fork(s0 or stale, 1),
            lambda: pool.unpin(sw[:1] or [stale]),
            lambda: pool.evict(2.0),
            lambda: pool.evict(-1),
            lambda: pool.set_clock(self.now - 1.0),
            lambda: pool.open_with_prefix([1, 2, 3], [4]),
            lambda: pool.admit(np.array([1.0])),
        ]
        before = snapshot(pool, list(self.reqs))
        with pytest.raises(kvpool.KVPoolError):
            self.rng.choice(calls)()
        assert snapshot(pool, list(self.reqs)) == before

    OPS = ["new"] * 4 + ["decode"] * 3 + ["admit", "cache", "close", "close", "swap_out", "swap_out", "swap_in",
                                         "swap_in", "fork", "truncate", "chain", "evict", "clock", "unpin",
                                         "bad", "bad"]

    def step(self):
        kind = self.rng.choice(self.OPS + ["clear"] * (self.rng.random() < 0.1) + ["reset"] * (self.rng.random() < 0.02))
        before = snapshot(self.pool, list(self.reqs))
        try:
            with self.rng.choice(MODES)():
                getattr(self, "op_" + kind)()
        except REFUSED:
            if kind != "new":  # new opens before its extend is refused, then closes
                assert snapshot(self.pool, list(self.reqs)) == before, f"a refused {kind} changed the pool"
            return kind, True
        self.pool.check()
        a = self.pool.allocator
        assert (a.pending_offloads, a.pending_loads, a.pending_copies) == (0, 0, 0)
        for h in self.reqs:
            self.verify(h)
        return kind, False


CONFIGS = list(itertools.product([1, 16], ["token", "paged"],
                                 [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn],
                                 ["write_back", "write_through"]))


@pytest.mark.parametrize("page_size,layout,dtype,policy", CONFIGS, ids=lambda v: str(v).replace("torch.", ""))
def test_random_sequences_keep_every_request_s_kv(page_size, layout, dtype, policy):
    kinds, refused = [], 0
    for seed in range(2):
        run = Run(seed, page_size, layout, dtype, policy)
        for _ in range(110):
            kind, was_refused = run.step()
            kinds.append(kind)
            refused += was_refused
        held = list(run.reqs)
        run.pool.reset()  # swapped-out requests' host pages come back too; the prefix cache stays
        run.pool.check()
        pool = run.pool
        assert (pool.used_pages, pool.open_requests) == (0, 0)
        assert (pool.free_pages, pool.host_free_pages) == (pool.capacity_pages - pool.pinned_pages,
                                                           pool.host_pages - 1)
        assert not any(pool.is_open(h) for h in held)
    a = run.pool.allocator
    assert {"swap_out", "swap_in", "bad", "fork"} <= set(kinds) and refused > 0
    assert a.offloaded_pages > 0, "the host tier was never used"


@pytest.mark.parametrize("page_size,layout", [(1, "token"), (16, "paged")])
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_random_sequences_on_the_device_table_path(page_size, layout, policy):
    """The same sequences with req_to_token updated as a device pool updates it (the
    packed update and the table kernel; copy-on-write rewrites the moved positions)."""
    for seed in range(2):
        run = Run(100 + seed, page_size, layout, torch.bfloat16, policy)
        run.pool._table_np = None
        for _ in range(110):
            run.step()
