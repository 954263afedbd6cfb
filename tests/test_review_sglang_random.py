"""Random radix-cache traffic on a SlotAllocator (page sizes 1, 2 and 4; with and without KV
events; with a write_back or write_through host tier) against what SGLang's RadixCache and
HiRadixCache tests assert of any prefix cache, checked after every call:

- a hit serves exactly the K/V its prompt's prefix wrote (each slot is tagged with the token
  prefix that filled it; copies, offloads and loads move the tags in the documented order), so a
  held page that was evicted or handed out again shows as a wrong tag in its request;
- `evict(n)` frees min(n, evictable) pages (kvpool's rule: exactly what it can, up to n);
- evictable pages by priority add up to evictable pages, held + free + unheld pinned pages are the
  capacity, and protected (cached, not evictable) pages are held or pinned (SGLang: evictable +
  protected = total);
- the KV events' live set is the cache on each tier; hit + miss tokens are the prompt tokens;
- a refused call (PoolExhaustedError) leaves the stats and every request as they were, and was
  short of room (an extend: free_pages; a swap_out: host pages).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import kvpool

SYSTEMS = [list(range(1000, 1024)), list(range(2000, 2012)), [3000, 3001, 3002]]


class Sim:
    def __init__(self, page_size: int, seed: int, host_pages: int = 0, host_policy: str = "write_back",
                 kv_events: bool = True):
        self.rng = np.random.default_rng(seed)
        self.a = kvpool.SlotAllocator(num_pages=96 // page_size + 1, page_size=page_size, max_requests=6,
                                      max_context_len=64, hash_seed=seed, handle_seed=seed, manual_clock=True,
                                      max_pinned_pages=24 // page_size, host_pages=host_pages,
                                      host_policy=host_policy, kv_events=kv_events)
        self.tag: dict[int, tuple] = {}  # slot -> (salt, tokens of the prefix that wrote it)
        self.htag: dict[int, tuple | None] = {}  # host slot -> the same, as the offload copied it
        self.swapped: set[int] = set()
        self.live: Counter = Counter()  # (medium, hash) -> Stored minus Removed, from the KV events
        self.reqs: dict[int, tuple[int, list[int]]] = {}  # handle -> (salt, known tokens)
        self.now = 0.0

    # -- oracle -------------------------------------------------------------------------------
    def events(self) -> None:
        """SGLang's test_kv_cache_events: Stored for what is cached, Removed for what goes, so the
        events' live set is the cache, on each tier."""
        if not self.a.kv_events:
            return
        ev = self.a.take_events()
        for kind, hi, lo, medium in zip(ev["kind"].tolist(), ev["hash_hi"].tolist(), ev["hash_lo"].tolist(),
                                        ev["medium"].tolist()):
            if kind == 2:
                self.live.clear()
            else:
                self.live[(medium, hi, lo)] += 1 if kind == 0 else -1
        assert set(self.live.values()) <= {0, 1}, "a page stored twice or removed unstored"
        per_medium = Counter(k[0] for k, v in self.live.items() if v)
        assert (per_medium[0], per_medium[1]) == (self.a.cached_pages, self.a.host_cached_pages)

    def verify(self) -> None:
        a = self.a
        a.check()
        self.events()
        s = a.stats()
        assert sum(s.evictable_pages_by_priority) == s.evictable_pages <= s.cached_pages
        assert 0 <= a.capacity_pages - s.used_pages - s.free_pages <= s.pinned_pages <= a.max_pinned_pages
        assert s.cached_pages - s.evictable_pages <= s.used_pages + s.pinned_pages, "protected = held or pinned"
        for h, (salt, toks) in self.reqs.items():
            assert a.is_swapped(h) == (h in self.swapped)
            if h in self.swapped:
                assert a.length(h) == len(toks)
                continue
            slots = a.slots(h)
            assert a.length(h) == len(slots) <= len(toks)
            for i, slot in enumerate(slots.tolist()):
                assert self.tag.get(slot) == (salt, tuple(toks[: i + 1])), (h, i, slot)

    def sync(self) -> None:
        """Runs the queued transfers in the documented order: offloads, loads, copies."""
        a, P = self.a, self.a.page_size
        if a.host_pages:
            dev, host = a.take_offloads()
            for d, hp in zip(dev.tolist(), host.tolist()):
                for o in range(P):
                    self.htag[hp * P + o] = self.tag.get(d * P + o)
            host, dev = a.take_loads()
            for hp, d in zip(host.tolist(), dev.tolist()):
                for o in range(P):
                    self.tag[d * P + o] = self.htag.get(hp * P + o)
        src, dst = a.take_copies()
        for s_, d_ in zip(src.tolist(), dst.tolist()):
            self.tag[d_] = self.tag[s_]

    def write(self, h: int, start: int, slots: np.ndarray) -> None:
        self.sync()
        salt, toks = self.reqs[h]
        for i, slot in enumerate(slots.tolist()):
            self.tag[slot] = (salt, tuple(toks[: start + i + 1]))

    def refused(self, call, grow: dict[int, int] | None = None) -> bool:
        """Runs `call`; on PoolExhaustedError checks that nothing changed and, for an extend
        (`grow`: handle -> new tokens), that the room was short: SGLang's budget is
        available + evictable, kvpool's is free_pages (FREE + evictable, docs/allocator.md,
        Budgeting a step), plus at most one copy per request writing into a partly filled page."""
        before = self.a.stats()
        lengths = {h: self.a.length(h) for h in self.reqs}
        try:
            call()
        except kvpool.PoolExhaustedError:
            after = self.a.stats()
            assert after == before, "a refused call changed the pool"
            assert {h: self.a.length(h) for h in self.reqs} == lengths
            if grow is not None:
                P = self.a.page_size
                need = sum(-(-(lengths[h] + n) // P) - -(-lengths[h] // P) for h, n in grow.items())
                copies = sum(1 for h, n in grow.items() if n and lengths[h] % P)
                assert need + copies > before.free_pages, ("refused with room", need, copies, before)
            return True
        return False

    # -- operations ---------------------------------------------------------------------------
    def open(self) -> None:
        """One to three prompts in one open_with_prefix call (a step's new requests), each then
        prefilled; a batch's hits are held together before any host hit takes a page."""
        room = self.a.max_requests - len(self.reqs)
        if room <= 0:
            return
        rng = self.rng
        prompts, salts = [], []
        for _ in range(int(rng.integers(1, min(3, room) + 1))):
            base = SYSTEMS[rng.integers(len(SYSTEMS))]
            prompts.append(base[: rng.integers(1, len(base) + 1)] + rng.integers(0, 6, rng.integers(1, 12)).tolist())
            salts.append(int(rng.integers(0, 2)))
        hits, misses, host_hits = self.a.hit_tokens, self.a.miss_tokens, self.a.host_hit_tokens
        hs, cs = self.a.open_with_prefix(np.array(sum(prompts, [])), [len(p) for p in prompts], salt=salts)
        hs, cs = hs.tolist(), cs.tolist()
        for prompt, c in zip(prompts, cs):
            assert c <= len(prompt) - 1 and c % self.a.page_size == 0
        total = sum(len(p) for p in prompts)
        assert (self.a.hit_tokens - hits, self.a.miss_tokens - misses) == (sum(cs), total - sum(cs))
        assert 0 <= self.a.host_hit_tokens - host_hits <= sum(cs)
        for h, salt, prompt in zip(hs, salts, prompts):
            self.reqs[h] = (salt, prompt)
        self.sync()  # the host hits' loads
        self.verify()  # each hit's slots carry its own prompt's prefix, token by token
        for h, prompt, c in zip(hs, prompts, cs):
            out = []
            if self.refused(lambda: out.append(self.a.extend([h], [len(prompt) - c])), {h: len(prompt) - c}):
                self.a.close([h])
                del self.reqs[h]
                continue
            self.write(h, c, out[0])

    def decode(self) -> None:
        live = [h for h in self.reqs if h not in self.swapped]
        if not live:
            return
        hs = [h for h in live if self.rng.random() < 0.6] or live[:1]
        n = [int(self.rng.integers(1, 4)) for _ in hs]
        n = [min(k, self.a.max_context_len - self.a.length(h)) for k, h in zip(n, hs)]
        new = [self.rng.integers(0, 6, k).tolist() for k in n]
        starts = [self.a.length(h) for h in hs]
        out = []
        call = lambda: out.append(self.a.extend(hs, n, tokens=np.array(sum(new, []), dtype=np.int64)))  # noqa: E731
        for h, t, s0 in zip(hs, new, starts):
            salt, toks = self.reqs[h]
            self.reqs[h] = (salt, toks[:s0] + t)
        if self.refused(call, dict(zip(hs, n))):
            for h, s0 in zip(hs, starts):
                salt, toks = self.reqs[h]
                self.reqs[h] = (salt, toks[:s0])
            return
        self.sync()
        off = 0
        for h, k, s0 in zip(hs, n, starts):
            salt, toks = self.reqs[h]
            for i, slot in enumerate(out[0][off: off + k].tolist()):
                self.tag[slot] = (salt, tuple(toks[: s0 + i + 1]))
            off += k

    def pick(self, swapped_too: bool = False) -> int | None:
        hs = [h for h in self.reqs if swapped_too or h not in self.swapped]
        return hs[self.rng.integers(len(hs))] if hs else None

    def priority_kw(self) -> dict:
        r = self.rng.random()
        if r < 0.5:
            return {}
        prio = int(self.rng.choice([0, 10, 35, 60, 90, 100]))
        return {"priority": prio, "retain_s": float(self.rng.integers(1, 5))} if r < 0.75 else {"priority": prio}

    def step(self) -> None:
        a, rng = self.a, self.rng
        ops = ["open", "open", "decode", "decode", "close", "cache", "evict", "fork", "truncate", "clock", "unpin"]
        op = rng.choice(ops + (["swap_out", "swap_in", "close_swapped"] if a.host_pages else []))
        h = self.pick()
        if op == "open":
            self.open()
        elif op == "decode":
            self.decode()
        elif op == "close" and h is not None:
            cache = bool(rng.random() < 0.8)
            a.close([h], cache=cache, **(self.priority_kw() if cache else {}))
            del self.reqs[h]
        elif op == "cache" and h is not None:
            a.cache([h], **self.priority_kw())
        elif op == "evict":
            n = int(rng.integers(0, 8))
            expect = min(n, a.evictable_pages)
            assert a.evict(n) == expect, "evict(n) frees min(n, evictable)"
        elif op == "fork" and h is not None and len(self.reqs) < a.max_requests:
            (child,) = a.fork(h, 1).tolist()
            self.reqs[child] = (self.reqs[h][0], list(self.reqs[h][1][: a.length(h)]))
        elif op == "truncate" and h is not None:
            new_len = int(rng.integers(0, a.length(h) + 1))
            a.truncate([h], [new_len])
            salt, toks = self.reqs[h]
            # A request truncated inside its prompt forgets the prompt from there (docs/allocator.md).
            self.reqs[h] = (salt, toks[:new_len])
        elif op == "clock":
            self.now += float(rng.integers(0, 3))
            a.set_clock(self.now)
        elif op == "unpin" and h is not None:
            if rng.random() < 0.1:
                a.clear_cache()  # SGLang's reset of the tree; open requests keep their pages
                assert a.cached_pages == a.pinned_pages == a.evictable_pages == 0
            else:
                a.unpin([h])
        elif op == "swap_out" and h is not None:
            others = {int(p) for g in self.reqs if g != h and g not in self.swapped for p in a.pages(g)}
            alone = len(set(a.pages(h).tolist()) - others)
            host_free = a.host_free_pages
            if not self.refused(lambda: a.swap_out([h])):
                self.swapped.add(h)
            else:  # it needs a host page for each page it holds alone (docs/allocator.md, Swap)
                assert alone > host_free, ("swap_out refused with room", alone, host_free)
        elif op == "swap_in" and self.swapped:
            g = sorted(self.swapped)[rng.integers(len(self.swapped))]
            if not self.refused(lambda: a.swap_in([g])):
                self.swapped.discard(g)
        elif op == "close_swapped" and self.swapped:
            g = self.swapped.pop()
            a.close([g])
            del self.reqs[g]
        self.sync()
        self.verify()


def run_then_reset(sim, steps: int = 250) -> None:
    """``steps`` random steps, then a reset: every page comes back and the store still agrees."""
    for _ in range(steps):
        sim.step()
    sim.a.reset()
    sim.reqs.clear()
    sim.swapped.clear()
    sim.sync()
    sim.verify()
    assert sim.a.used_pages == 0


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("seed", range(6))
def test_random_radix_traffic_keeps_sglang_invariants(page_size, seed):
    # Without KV events the index keys pages by another chain: the same hits (docs/allocator.md).
    sim = Sim(page_size, seed, kv_events=seed % 3 != 0)
    run_then_reset(sim)


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_with_a_host_tier(policy, page_size, seed):
    """HiCache's expectations: evicted prefixes come back from the host with their own K/V, swapped
    requests come back exact, and held pages are never dropped."""
    sim = Sim(page_size, 100 + seed, host_pages=48 // page_size + 1, host_policy=policy)
    run_then_reset(sim)
