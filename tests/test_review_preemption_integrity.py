"""Outside check: an engine loop over a CPU KVPool with a host tier and prefix caching that
admits (prefix hits, forks), decodes, preempts by swap_out when the pool runs out and swaps
back in when room returns. Every position's K/V is a function of the tokens up to it, so any
request computing the same prefix writes the same bytes; after every step each running request
reads back exactly its expected K/V through its slots and its req_to_token row."""

import random
import zlib

import numpy as np
import pytest
import torch

import kvpool
from kvpool.errors import PoolExhaustedError, RequestSwappedOutError

L, H, D = 2, 2, 4
POLICIES = ["write_back", "write_through"]


def kv_row(prefix):
    """K/V of the position whose tokens up to and including it are ``prefix``: [L, 2, H, D]."""
    h = zlib.crc32(np.asarray(prefix, np.int64).tobytes()) % (1 << 16)  # exact in float32 (x64)
    return torch.arange(L * 2 * H * D, dtype=torch.float32).view(L, 2, H, D) + float(h) * 64


def make_pool(ps, num_pages, policy, host_pages=64):
    return kvpool.KVPool(L, H, D, dtype=torch.float32, page_size=ps, num_pages=num_pages,
                         max_requests=24, max_context_len=96, host_pages=host_pages,
                         host_policy=policy, hash_seed=7)


def write(pool, h, toks, start):
    """Write positions start..len(toks)-1 of request ``h`` (already extended to len(toks))."""
    if start >= len(toks):  # a prefix hit covered the whole prompt
        return
    rows = torch.stack([kv_row(toks[:i + 1]) for i in range(start, len(toks))])
    for layer in range(L):
        pool.write(layer, pool.slots(h)[start:], rows[:, layer, 0].contiguous(), rows[:, layer, 1].contiguous())


def grow(pool, h, toks, t):
    """One decode step of request ``h``: extend by token ``t`` and write its K/V."""
    pool.extend([h], [1], tokens=[t])
    toks.append(t)
    write(pool, h, toks, len(toks) - 1)


def verify(pool, h, toks):
    n = len(toks)
    assert pool.allocator.length(h) == n
    slots = np.asarray(pool.slots(h))
    row = int(pool.allocator.rows([h])[0])
    assert (pool.req_to_token[row, :n].cpu().numpy() == slots).all(), "req_to_token row != slots"
    want = torch.stack([kv_row(toks[:i + 1]) for i in range(n)])
    for layer in range(L):
        k, v = pool.read(layer, slots)
        assert torch.equal(k, want[:, layer, 0]), f"request {h} layer {layer}: K differs"
        assert torch.equal(v, want[:, layer, 1]), f"request {h} layer {layer}: V differs"


class Engine:
    """``run`` / ``swapped``: handle -> tokens; ``age``: admission order (youngest preempted first)."""

    def __init__(self, pool, rng):
        self.pool, self.rng = pool, rng
        self.run, self.swapped, self.age, self.clock = {}, {}, {}, 0
        self.prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(3, 20))] for _ in range(3)]

    def _born(self, h, toks):
        self.run[int(h)], self.age[int(h)], self.clock = toks, self.clock, self.clock + 1

    def preempt(self, keep=None):
        """swap_out (one call) the youngest one or two running requests but ``keep``."""
        cands = sorted((h for h in self.run if h != keep), key=lambda x: -self.age[x])
        if not cands:
            return False
        out = cands[:self.rng.choice((1, 2))]
        try:
            self.pool.swap_out(out)
        except PoolExhaustedError:  # no host room (nothing moved): drop them, recompute later
            self.pool.close(out)
            self.run = {h: t for h, t in self.run.items() if h not in out}
            return True
        for h in out:  # check() asserts is_swapped
            self.swapped[h] = self.run.pop(h)
        return True

    def swap_back(self):
        """swap_in the oldest swapped requests, one or two a call, while there is room."""
        while self.swapped:
            batch = sorted(self.swapped, key=lambda x: self.age[x])[:self.rng.choice((1, 2))]
            free0 = self.pool.allocator.free_pages
            try:
                self.pool.swap_in(batch)
            except PoolExhaustedError:  # changes nothing
                assert self.pool.allocator.free_pages == free0
                assert all(self.pool.is_swapped(h) for h in batch)
                return
            for h in batch:
                self.run[h] = self.swapped.pop(h)

    def admit(self):
        if len(self.run) + len(self.swapped) >= 20:
            return
        r = self.rng
        toks = list(r.choice(self.prefixes)) + [r.randrange(1, 50) for _ in range(r.randrange(0, 6))]
        by_admit = r.random() < 0.3  # open + prefill in one call, no prefix lookup
        while True:
            h, hit = None, 0
            try:
                if by_admit:
                    h = int(self.pool.admit([len(toks)], tokens=toks)[0][0])
                else:
                    hs, hits = self.pool.open_with_prefix(toks, [len(toks)])
                    h, hit = int(hs[0]), int(hits[0])
                    if len(toks) > hit:
                        self.pool.extend([h], [len(toks) - hit], tokens=toks[hit:])
                break
            except PoolExhaustedError:  # admit / extend: nothing changed; close what opened
                if h is not None:
                    self.pool.close([h])
                if not self.preempt():
                    return
        write(self.pool, h, toks, hit)
        self._born(h, list(toks))

    def fork(self):
        if not self.run or len(self.run) + len(self.swapped) >= 20:
            return
        parent = self.rng.choice(sorted(self.run))
        kid = int(self.pool.fork(parent, 1)[0])
        self._born(kid, list(self.run[parent]))

    def decode(self):
        """One token for every running request: one batched extend (fork siblings extending
        into their shared last page in the same call), or one extend a request."""
        if self.rng.random() < 0.5:
            self._decode_batch()
            return
        for h in sorted(self.run, key=lambda x: self.age[x]):
            if h not in self.run:  # preempted by an older request's decode this step
                continue
            while h in self.run and len(self.run[h]) < 90:
                try:
                    grow(self.pool, h, self.run[h], self.rng.randrange(1, 50))
                    break
                except PoolExhaustedError:  # atomic: nothing extended
                    if not self.preempt(keep=h):
                        self.preempt()  # itself: the only one left running

    def _decode_batch(self):
        while True:
            batch = sorted((h for h in self.run if len(self.run[h]) < 90), key=lambda x: self.age[x])
            if not batch:
                return
            nxt = [self.rng.randrange(1, 50) for _ in batch]
            try:
                ext = self.pool.extend(batch, [1] * len(batch), tokens=nxt)
                break
            except PoolExhaustedError:  # atomic: nothing extended
                self.preempt()
        assert list(ext.slots) == [int(self.pool.slots(h)[-1]) for h in batch]
        for h, t in zip(batch, nxt):
            self.run[h].append(t)
        rows = torch.stack([kv_row(self.run[h]) for h in batch])  # one write a layer, as a model
        for layer in range(L):
            self.pool.write(layer, ext.out_cache_loc, rows[:, layer, 0].contiguous(), rows[:, layer, 1].contiguous())

    def finish(self):
        r = self.rng
        if self.run and r.random() < 0.3:
            h = r.choice(sorted(self.run))
            self.pool.close([h], cache=r.random() < 0.7)
            del self.run[h]
        if self.run and r.random() < 0.2:  # publish mid-flight: later prompts hit, swap_in re-takes
            self.pool.cache([r.choice(sorted(self.run))])
        if self.run and r.random() < 0.15:  # speculative rollback, maybe into a shared page
            h = r.choice(sorted(self.run))
            self.run[h] = self.run[h][:max(1, len(self.run[h]) - r.randrange(1, 6))]
            self.pool.truncate([h], [len(self.run[h])])
        if r.random() < 0.1:
            self.pool.evict(r.randrange(1, 8))
        if self.swapped and r.random() < 0.1:
            h = r.choice(sorted(self.swapped))
            self.pool.close([h])
            del self.swapped[h]

    def check(self):
        a = self.pool.allocator
        a.check()
        assert a.pending_offloads == 0 and a.pending_loads == 0 and a.pending_copies == 0
        for h, toks in self.run.items():
            verify(self.pool, h, toks)
        for h in self.swapped:
            assert self.pool.is_swapped(h) and a.length(h) == len(self.swapped[h])

    def step(self):
        self.swap_back()
        if self.rng.random() < 0.6:
            self.admit()
        if self.rng.random() < 0.3:
            self.fork()
        self.decode()
        self.finish()
        self.check()

    def drain(self):
        """Close everything; then every device and host page comes back."""
        a = self.pool.allocator
        self.pool.close(list(self.run) + list(self.swapped))
        a.check()
        # free_pages counts CACHED (evictable) pages too: nothing may stay held.
        assert a.free_pages == a.num_pages - 1 and a.host_free_pages == a.host_pages - 1
        a.clear_cache()
        a.check()
        assert a.cached_pages == 0 and a.host_cached_pages == 0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("ps,num_pages,host_pages", [(1, 128, 256), (4, 40, 96), (16, 12, 96), (4, 40, 20)])
@pytest.mark.parametrize("seed", range(5))
def test_engine_loop_keeps_kv_exact(policy, ps, num_pages, host_pages, seed):
    pool = make_pool(ps, num_pages, policy, host_pages=host_pages)
    eng = Engine(pool, random.Random(seed * 1000 + ps))
    for _ in range(40):
        eng.step()
    assert pool.allocator.offloaded_pages > 0  # the pool did run out: preemption happened
    eng.drain()


def _open_compute(pool, toks):
    h = int(pool.open(1)[0])
    pool.extend([h], [len(toks)], tokens=toks)
    write(pool, h, toks, 0)
    return h


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("victim", ["parent", "child"])
def test_preempt_with_cow_pending_last_page(policy, victim):
    """A's partly filled last page is shared with its fork B; one of them is swapped out, the
    other writes into that page (its copy-on-write, or not, as the swap left it), then the
    first comes back: both read their own tokens."""
    pool = make_pool(4, 16, policy)
    ta = list(range(1, 7))  # 6 tokens: the second page is half full
    A = _open_compute(pool, ta)
    B = int(pool.fork(A, 1)[0])
    toks = {A: list(ta), B: list(ta)}
    out, stay = (A, B) if victim == "parent" else (B, A)
    pool.swap_out([out])
    for t in (40, 41, 42):
        grow(pool, stay, toks[stay], t)
    pool.allocator.check()
    verify(pool, stay, toks[stay])
    pool.swap_in([out])
    grow(pool, out, toks[out], 30)
    pool.allocator.check()
    for h in (A, B):
        verify(pool, h, toks[h])
    pool.close([A, B])


@pytest.mark.parametrize("policy", POLICIES)
def test_preempt_right_after_host_hit(policy):
    """A publishes a prefix and closes; its device copies are evicted (the entry lives on the
    host); B's prefix hit loads them, B is swapped out at once, later swapped back in when the
    device is crowded with CACHED pages of other prompts, and reads exactly A's K/V for the shared positions."""
    pool = make_pool(4, 12, policy)
    a = pool.allocator
    pre = list(range(1, 13))  # 3 full pages
    A = _open_compute(pool, pre + [99])
    pool.close([A], cache=True)
    pool.evict(100)
    assert a.cached_pages == 0 and a.host_cached_pages >= 3
    tb = pre + [7, 8]
    B, hit = (int(x[0]) for x in pool.open_with_prefix(tb, [len(tb)]))
    assert hit == 12 and a.loaded_pages >= 3
    pool.extend([B], [2], tokens=[7, 8])
    write(pool, B, tb, 12)
    verify(pool, B, tb)
    pool.swap_out([B])
    for base in (200, 300):
        C = _open_compute(pool, list(range(base, base + 16)))
        pool.close([C], cache=True)
    pool.swap_in([B])
    a.check()
    verify(pool, B, tb)
    grow(pool, B, tb, 9)
    verify(pool, B, tb)
    pool.close([B])


@pytest.mark.parametrize("policy", POLICIES)
def test_swap_in_evicts_cached_pages_and_their_copies_stay_exact(policy):
    """The device is full of CACHED pages when a swapped request comes back: swap_in evicts
    them (under write_back offloading them first). A later prompt hits those evicted pages on
    the host and reads exactly the K/V written before the eviction."""
    pool = make_pool(4, 10, policy)
    a = pool.allocator
    ta = list(range(1, 19))  # 5 pages
    A = _open_compute(pool, ta)
    pool.swap_out([A])
    tc = list(range(100, 128))  # 7 full pages
    C = _open_compute(pool, tc)
    pool.close([C], cache=True)
    assert a.free_pages == 9 and a.cached_pages == 7  # 2 FREE + 7 CACHED; A's 5 on the host
    offl = a.offloaded_pages
    pool.swap_in([A])
    a.check()
    verify(pool, A, ta)
    assert a.cached_pages == 4  # swap_in had to evict 3 of C's copies
    if policy == "write_back":
        assert a.offloaded_pages == offl + 3  # offloaded as they were evicted
    pool.close([A])
    D, hit = (int(x[0]) for x in pool.open_with_prefix(tc + [5], [len(tc) + 1]))
    assert hit == 28
    grow(pool, D, tc, 5)
    verify(pool, D, tc)
    pool.close([D])


@pytest.mark.parametrize("policy", POLICIES)
def test_swapped_requests_fill_the_host_then_device_pressure_and_close(policy):
    """A publishes 3 pages and is swapped out (its registered pages stay CACHED on the device,
    their host pages reserved); X fills the host. C then takes every device page, evicting A's
    copies (under write_back offloading them into the reserved host pages): A still comes back
    exact. X, closed while swapped out (close(cache=True) refused first), returns its host page."""
    pool = make_pool(4, 12, policy, host_pages=6)
    a = pool.allocator
    ta = list(range(1, 14))
    A = _open_compute(pool, ta)
    pool.cache([A])
    pool.swap_out([A])
    X = _open_compute(pool, [300, 301, 302, 303])
    pool.swap_out([X])
    assert a.host_free_pages == 0 and a.cached_pages == 3
    C = _open_compute(pool, list(range(100, 144)))
    assert a.free_pages == 0 and a.cached_pages == 0
    pool.close([C])
    pool.swap_in([A])
    a.check()
    verify(pool, A, ta)
    with pytest.raises(RequestSwappedOutError):
        pool.close([X], cache=True)
    assert pool.is_swapped(X) and a.host_free_pages == 4  # A's host pages are free or cached
    pool.close([X, A])
    a.check()
    assert not a.is_open(X) and a.free_pages == 11 and a.host_free_pages == 5
