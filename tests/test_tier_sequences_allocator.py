"""SlotAllocator with a host tier, driven the way an engine drives it directly: several
calls per step leave offloads, loads and copy-on-write copies queued, and once per step
the engine runs ``take_offloads`` (device -> host), ``take_loads`` (host -> device),
``take_copies`` (device -> device), in that order, then the step's K/V writes.

Page contents are simulated (one int per slot, a function of the token, its position and
the salt), so after every step each request must read exactly its tokens' values: after
prefix hits from either tier, swaps, forks, truncates, evictions and clear_cache, at page
sizes 1, 4 and 16, under both policies, with host tiers from 2 usable pages up.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

import kvpool
from kvpool import SlotAllocator

CTX = 64


def value(token, pos, salt):
    return (int(token) * 1_000_003 + pos * 7919 + salt * 104729) % (1 << 40) + 1


class Engine:
    def __init__(self, seed, page_size, num_pages, host_pages, policy):
        self.rng = random.Random(seed)
        self.a = SlotAllocator(num_pages, page_size, 8, CTX, host_pages=host_pages, host_policy=policy,
                               hash_seed=seed, handle_seed=seed)
        self.ps = page_size
        self.table = np.zeros((8, CTX), dtype=np.int32)
        self.dev = np.zeros(num_pages * page_size, dtype=np.int64)
        self.host = np.zeros((host_pages, page_size), dtype=np.int64)
        self.reqs: dict[int, list] = {}  # handle -> [tokens, salt]
        self.prompt: dict[int, list] = {}
        self.swapped: set[int] = set()
        self.writes: list[tuple[int, int]] = []  # (handle, position) this step writes
        self.bases = [[self.rng.randrange(500) for _ in range(CTX)] for _ in range(3)]

    def run_step(self):
        """Drain the queues in the documented order, then write this step's positions
        through the table (a later call of the step may have moved them)."""
        a, ps = self.a, self.ps
        for d, h in zip(*a.take_offloads()):
            self.host[h] = self.dev[d * ps : (d + 1) * ps]
        for h, d in zip(*a.take_loads()):
            self.dev[d * ps : (d + 1) * ps] = self.host[h]
        for s, d in zip(*a.take_copies()):
            self.dev[d] = self.dev[s]
        for h, pos in self.writes:
            if h in self.reqs and h not in self.swapped and pos < a.length(h):
                tokens, salt = self.reqs[h]
                self.dev[self.table[int(a.rows([h])[0]), pos]] = value(tokens[pos], pos, salt)
        self.writes.clear()

    def verify(self):
        a = self.a
        a.check()
        assert (a.pending_offloads, a.pending_loads, a.pending_copies) == (0, 0, 0)
        for h, (tokens, salt) in self.reqs.items():
            assert a.length(h) == len(tokens) and a.is_swapped(h) == (h in self.swapped)
            if h in self.swapped:
                continue
            slots = a.slots(h)
            assert self.table[int(a.rows([h])[0]), : len(slots)].tolist() == slots.tolist()
            want = [value(t, i, salt) for i, t in enumerate(tokens)]
            assert self.dev[slots].tolist() == want, f"request {h:#x}: wrong contents"

    def resident(self):
        return [h for h in self.reqs if h not in self.swapped]

    def grow(self, hs, counts, tokens):
        self.a.extend(hs, counts, table=self.table, tokens=tokens)
        j = 0
        for h, c in zip(hs, counts):
            start = len(self.reqs[h][0])
            self.reqs[h][0] = self.reqs[h][0] + list(tokens[j : j + c])
            self.writes += [(h, p) for p in range(start, start + c)]
            j += c

    # Calls that read what this step writes (cache, fork, swap_out, truncate, close)
    # come after its writes: the engine runs the step first.

    def op_new(self):
        n = self.rng.randrange(1, CTX // 2)
        prompt, salt = self.rng.choice(self.bases)[:n], self.rng.choice([0, 0, 3])
        hs, cached = self.a.open_with_prefix(prompt, [n], salt, table=self.table)
        h, c = int(hs[0]), int(cached[0])
        self.reqs[h], self.prompt[h] = [prompt[:c], salt], list(prompt)
        try:
            self.grow([h], [n - c], prompt[c:])
        except kvpool.PoolExhaustedError:
            pass

    def op_decode(self):
        res = self.resident()
        if not res:
            return
        hs = self.rng.sample(res, self.rng.randint(1, len(res)))
        counts = [self.rng.randint(1, 5) for _ in hs]
        toks = []
        for h, c in zip(hs, counts):
            at, pr = len(self.reqs[h][0]), self.prompt.get(h, [])
            toks += [pr[p] if p < len(pr) else self.rng.randrange(500) for p in range(at, at + c)]
        self.grow(hs, counts, toks)

    def op_cache(self):
        if self.resident():
            self.run_step()
            self.a.cache([self.rng.choice(self.resident())], priority=self.rng.choice([None, 0, 60]))

    def op_close(self):
        if self.reqs:
            h = self.rng.choice(list(self.reqs))
            self.run_step()
            self.a.close([h], cache=h not in self.swapped and self.rng.random() < 0.7)
            del self.reqs[h]
            self.swapped.discard(h)

    def op_swap_out(self):
        if self.resident():
            hs = self.rng.sample(self.resident(), self.rng.randint(1, min(2, len(self.resident()))))
            self.run_step()
            self.a.swap_out(hs)
            self.swapped.update(hs)

    def op_swap_in(self):
        if self.swapped:
            hs = self.rng.sample(sorted(self.swapped), self.rng.randint(1, min(2, len(self.swapped))))
            self.a.swap_in(hs)
            self.swapped.difference_update(hs)
            for h in hs:  # their pages changed: the engine rewrites their rows
                self.table[int(self.a.rows([h])[0]), : self.a.length(h)] = self.a.slots(h)

    def op_fork(self):
        if self.resident():
            h = self.rng.choice(self.resident())
            self.run_step()
            kid = int(self.a.fork(h, 1, table=self.table)[0])
            self.reqs[kid], self.prompt[kid] = [list(self.reqs[h][0]), self.reqs[h][1]], list(self.prompt.get(h, []))

    def op_truncate(self):
        if self.resident():
            h = self.rng.choice(self.resident())
            n = self.rng.randint(0, len(self.reqs[h][0]))
            self.run_step()
            self.a.truncate([h], [n])
            if n < len(self.reqs[h][0]):
                self.prompt[h] = self.prompt.get(h, [])[:n]
            self.reqs[h][0] = self.reqs[h][0][:n]

    def op_evict(self):
        self.a.evict(self.rng.randint(0, 3))

    def op_clear(self):
        self.a.clear_cache()

    OPS = ["new"] * 3 + ["decode"] * 3 + ["cache", "close", "close", "swap_out", "swap_out", "swap_in", "swap_in",
                                         "fork", "truncate", "evict"]

    def step(self):
        for _ in range(self.rng.randint(1, 4)):
            kind = self.rng.choice(self.OPS + ["clear"] * (self.rng.random() < 0.05))
            try:
                getattr(self, "op_" + kind)()
            except (kvpool.PoolExhaustedError, kvpool.TooManyRequestsError, kvpool.ContextTooLongError):
                pass
        self.run_step()
        self.verify()


@pytest.mark.parametrize("page_size,policy", list(itertools.product([1, 4, 16], ["write_back", "write_through"])))
def test_queued_transfers_drained_once_a_step_keep_every_request_s_contents(page_size, policy):
    num_pages = {1: 40, 4: 12, 16: 6}[page_size]
    moved = 0
    for seed in range(40):
        host_pages = [3, 8, 30][seed % 3] * (5 if page_size == 1 else 1)
        eng = Engine(seed, page_size, num_pages, host_pages, policy)
        for _ in range(100):
            eng.step()
        moved += eng.a.loaded_pages
    assert moved > 0


def test_a_second_extend_in_one_step_may_move_what_the_first_handed_out():
    """docs/allocator.md: a copy queued by one call holds its source page, so the same
    step's next extend of the page's last holder copies it and moves its positions,
    those the first call handed out included; extend(table=) rewrites them."""
    a = SlotAllocator(16, 4, 4, 32)
    table = np.zeros((4, 32), dtype=np.int32)
    p = a.open(1)
    a.extend(p, [6], table=table)  # a full page and two slots of the next
    k = a.fork(int(p[0]), 1, table=table)
    first = a.extend(np.concatenate([p, k]), [1, 1], table=table)  # p copies; k writes in place
    assert a.pending_copies == 2
    a.extend(k, [1], table=table)  # k's page is held by p's queued copy: k copies it too
    row = int(a.rows(k)[0])
    assert a.slots(int(k[0]))[6] != first[1], "the position the first call gave k moved"
    assert table[row, :8].tolist() == a.slots(int(k[0])).tolist()
    src, dst = a.take_copies()
    assert first[1] in src.tolist()  # the moved position is copied from where it was
