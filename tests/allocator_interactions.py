"""A seeded random driver of ``SlotAllocator`` (with a host tier) as an engine drives it
directly: it runs the queued transfers itself, and not after every call. Several calls
(prefix hits from the host, extends that evict and copy on write, forks, truncates,
evictions, swaps) may queue work before one drain, which then runs everything queued so
far in the documented order (offloads, loads, copies) and then the step's K/V writes,
through the positions' current slots (docs/allocator.md: what was left queued
accumulates, and the same order over all of it stays safe).

Memory is simulated: one code per device slot and per host slot. After each drain every
open request must read its own codes (a function of its salt and true tokens up to each
position), and every page the KV events say a tier holds must hold that content. Two
allocators built alike run side by side; a refused call is made on the first only and
must change nothing, so the two keep answering alike.
"""

from __future__ import annotations

import random

import numpy as np
from interactions_common import EventMirror, Refused, Req, make_prompt

import kvpool


class AllocDriver:
    def __init__(self, seed: int, page_size: int, num_pages: int, host_pages: int, policy: str,
                 max_pinned: int | None = None) -> None:
        self.rng = random.Random(seed)
        self.P = P = page_size
        kw = dict(hash_seed=seed + 5, handle_seed=seed + 9, host_pages=host_pages, host_policy=policy,
                  manual_clock=True, max_pinned_pages=max_pinned)
        self.allocs = [kvpool.SlotAllocator(num_pages, P, 6, 8 * P + 5, **kw) for _ in range(2)]
        self.dev = np.full(num_pages * P, -1, dtype=np.int64)
        self.host = np.full((max(host_pages, 1), P), -1, dtype=np.int64)
        self.reqs: dict[int, Req] = {}
        self.pending: dict[int, set[int]] = {}  # handle -> positions written at the next drain
        self.closed: list[int] = []
        self.clock = 0.0
        self.mirror = EventMirror(P, seed + 5)
        self.systems = [[self.rng.randrange(4) for _ in range(self.rng.randrange(1, 3 * P + 2))] for _ in range(3)]
        self.log: list[str] = []
        self.seen: list[tuple[list[int], int]] = []

    def both(self, name: str, fn):
        a, b = self.allocs
        before = self.snapshot(a)
        try:
            ra = fn(a)
        except kvpool.KVPoolError as e:
            assert self.snapshot(a) == before, f"{name} refused ({type(e).__name__}: {e}) but changed the allocator"
            assert len(a.take_events()["kind"]) == 0, f"{name} refused but recorded events"
            raise Refused(type(e).__name__) from e
        rb = fn(b)
        assert repr(ra) == repr(rb), f"{name}: twin answered differently after a refusal: {ra!r} vs {rb!r}"
        return ra

    def snapshot(self, a: kvpool.SlotAllocator) -> tuple:
        per = []
        for h in list(self.reqs) + self.closed[-3:]:
            if not a.is_open(h):
                per.append((h, None))
                continue
            sw = a.is_swapped(h)
            per.append((h, a.length(h), sw, None if sw else a.slots(h).tolist(), a.known_tokens(h).tolist()))
        return (str(a.stats()), a.pending_offloads, a.pending_loads, a.evictable_pages_by_priority().tolist(), per)

    # ----- the engine's step ------------------------------------------------

    def drain(self) -> None:
        a, b = self.allocs
        off, ld, cp = a.take_offloads(), a.take_loads(), a.take_copies()
        off_b, ld_b, cp_b = b.take_offloads(), b.take_loads(), b.take_copies()
        for x, y in zip((*off, *ld, *cp), (*off_b, *ld_b, *cp_b)):
            assert np.array_equal(x, y), "twin queued different transfers"
        P = self.P
        for dp, hp in zip(*off):
            self.host[hp] = self.dev[dp * P:(dp + 1) * P]
        for hp, dp in zip(*ld):
            self.dev[dp * P:(dp + 1) * P] = self.host[hp]
        for s, d in zip(*cp):
            self.dev[d] = self.dev[s]
        for h, positions in self.pending.items():
            slots = a.slots(h)
            for pos in positions:
                self.dev[slots[pos]] = self.reqs[h].codes[pos]
        self.pending.clear()

    # ----- operations -------------------------------------------------------

    def op_open_prefix(self) -> None:
        prompts, salts = [], []
        for _ in range(self.rng.randrange(1, 3)):
            prompt, salt = make_prompt(self.rng, self.systems, self.seen, self.P)
            prompts.append(prompt)
            salts.append(salt)
        if self.rng.random() < 0.2:  # the same prompt twice in one batch
            prompts.append(prompts[0])
            salts.append(salts[0])
        flat = [t for p in prompts for t in p]
        lens = [len(p) for p in prompts]
        hs, cached = self.both("open_with_prefix", lambda a: a.open_with_prefix(flat, lens, salts))
        for h, c, pr, s in zip(hs.tolist(), cached.tolist(), prompts, salts):
            assert 0 <= c <= len(pr) - 1
            r = Req(s, prompt=list(pr))
            for t in pr[:c]:
                r.push(t, True)
            self.reqs[h] = r

    def op_extend(self) -> None:
        hs = [h for h, r in self.reqs.items() if not r.swapped]
        if not hs:
            return
        batch = self.rng.sample(hs, self.rng.randrange(1, len(hs) + 1))
        counts = [self.rng.choice([1, 1, 2, self.P, self.P + 1]) for _ in batch]
        tell = self.rng.random() < 0.85
        toks = []
        for h, c in zip(batch, counts):
            r = self.reqs[h]
            n = len(r.tokens)
            toks.append([r.prompt[n + i] if n + i < len(r.prompt) else self.rng.randrange(4) for i in range(c)])
        flat = [t for ts in toks for t in ts]
        self.both("extend", lambda a: a.extend(batch, counts, tokens=flat if tell else None))
        for h, ts in zip(batch, toks):
            r = self.reqs[h]
            for t in ts:
                pos = len(r.tokens)
                r.push(t, tell or pos < len(r.prompt))
                self.pending.setdefault(h, set()).add(pos)

    def op_fork(self) -> None:
        hs = [h for h, r in self.reqs.items() if h not in self.pending]
        if not hs:
            return
        h = self.rng.choice(hs)
        n = self.rng.randrange(1, 3)
        kids = self.both("fork", lambda a: a.fork(h, n))
        for k in kids.tolist():
            self.reqs[k] = self.reqs[h].clone()

    def op_truncate(self) -> None:
        if not self.reqs:
            return
        h = self.rng.choice(list(self.reqs))
        to = self.rng.randrange(0, len(self.reqs[h].tokens) + 1)
        self.both("truncate", lambda a: a.truncate([h], [to]))
        self.reqs[h].cut(to)
        if h in self.pending:
            self.pending[h] = {p for p in self.pending[h] if p < to}

    def op_cache(self) -> None:
        self.drain()  # cache() is for pages whose step has run
        hs = list(self.reqs)
        if not hs:
            return
        h = self.rng.choice(hs)
        pr = self.rng.choice([None, None, 0, 80, 100])
        rs = self.rng.choice([None, 4.0]) if pr is not None else None
        self.both("cache", lambda a: a.cache([h], priority=pr, retain_s=rs))
        self.seen.append((list(self.reqs[h].tokens), self.reqs[h].salt))

    def op_close(self) -> None:
        if not self.reqs:
            return
        h = self.rng.choice(list(self.reqs))
        cache = self.rng.random() < 0.7
        if cache:
            self.drain()
        self.both("close", lambda a: a.close([h], cache=cache))
        if cache:
            self.seen.append((list(self.reqs[h].tokens), self.reqs[h].salt))
        del self.reqs[h]
        self.pending.pop(h, None)
        self.closed.append(h)

    def op_evict(self) -> None:
        n = self.rng.randrange(0, 4)
        before = self.allocs[0].evictable_pages_by_priority()
        got = self.both("evict", lambda a: a.evict(n))
        want = before.copy()
        left = got
        for pr in range(101):  # the lowest priorities go first
            take = min(left, int(want[pr]))
            want[pr] -= take
            left -= take
        assert got == min(n, int(before.sum())), (got, n, before.sum())
        assert self.allocs[0].evictable_pages_by_priority().tolist() == want.tolist(), "evicted out of priority order"

    def op_chain(self) -> None:
        hs = [h for h, r in self.reqs.items() if not r.swapped]
        if not hs:
            return
        src = self.rng.choice(hs)
        hashes, toks, salt = self.allocs[0].chain_hashes(src)
        mp = self.rng.choice([None, 0, 1, 2])
        # With a length the open also extends, atomically: a length short of the match,
        # past max_context_len or beyond the room (counted after holding the match) is
        # refused with nothing changed.
        length = self.rng.choice([None, None, self.rng.randrange(0, 8 * self.P + 7)])
        h, cached = self.both("open_with_chain_hashes",
                              lambda a: a.open_with_chain_hashes(hashes, toks, salt, max_pages=mp, length=length))
        prompt = toks.tolist()
        r = Req(int(salt), prompt=prompt)
        for t in prompt[:int(cached)]:
            r.push(t, True)
        for pos in range(int(cached), int(cached) if length is None else length):
            r.push(prompt[pos] if pos < len(prompt) else self.rng.randrange(4), pos < len(prompt))
            self.pending.setdefault(int(h), set()).add(pos)
        self.reqs[int(h)] = r

    def op_swap_out(self) -> None:
        hs = [h for h, r in self.reqs.items() if not r.swapped and h not in self.pending]
        if not hs:
            return
        h = self.rng.choice(hs)
        self.both("swap_out", lambda a: a.swap_out([h]))
        self.reqs[h].swapped = True

    def op_swap_in(self) -> None:
        hs = [h for h, r in self.reqs.items() if r.swapped]
        if not hs:
            return
        h = self.rng.choice(hs)
        self.both("swap_in", lambda a: a.swap_in([h]))
        self.reqs[h].swapped = False

    def op_unpin(self) -> None:
        if self.reqs:
            h = self.rng.choice(list(self.reqs))
            self.both("unpin", lambda a: a.unpin([h]))

    def op_clock(self) -> None:
        self.clock += 3.0
        self.both("set_clock", lambda a: a.set_clock(self.clock))

    def op_drain(self) -> None:
        self.drain()

    def op_clear(self) -> None:
        self.both("clear_cache", lambda a: a.clear_cache())

    def op_reset(self) -> None:
        self.both("reset", lambda a: a.reset())
        self.closed += list(self.reqs)
        self.reqs.clear()
        self.pending.clear()

    OPS = [("op_open_prefix", 5), ("op_extend", 10), ("op_fork", 2), ("op_truncate", 3), ("op_cache", 2),
           ("op_close", 4), ("op_evict", 2), ("op_swap_out", 2), ("op_swap_in", 2), ("op_unpin", 1),
           ("op_clock", 1), ("op_drain", 4), ("op_clear", 0.3), ("op_reset", 0.1),
           ("op_chain", 1)]

    # ----- checks -----------------------------------------------------------

    def events(self) -> None:
        self.mirror.apply_twins(*self.allocs)

    def check(self) -> None:
        a = self.allocs[0]
        for x in self.allocs:
            x.check()
        self.events()
        for h, r in self.reqs.items():
            assert a.length(h) == len(r.tokens)
            assert a.known_tokens(h).tolist() == r.known(), (a.known_tokens(h).tolist(), r.known())
        if self.pending or a.pending_offloads or a.pending_loads:
            return  # bytes are checked after a drain
        for h, r in self.reqs.items():
            if r.swapped or not r.tokens:
                continue
            got = self.dev[a.slots(h)]
            want = np.array(r.codes, dtype=np.int64)
            assert np.array_equal(got, want), f"request {h}: wrong K/V at {np.nonzero(got != want)[0][:8].tolist()}"
        P = self.P
        for med, page, toks, codes in self.mirror.pages():
            got = self.dev[page * P:(page + 1) * P] if med == 0 else self.host[page]
            assert got.tolist() == codes, f"events say medium {med} page {page} holds {toks}"

    def run(self, steps: int) -> dict[str, int]:
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        counts: dict[str, int] = {}
        for step in range(steps):
            name = self.rng.choices(names, weights)[0]
            if name in ("op_open_prefix", "op_chain") and len(self.reqs) >= 6 and self.rng.random() < 0.7:
                name = "op_close"
            self.log.append(name)
            try:
                getattr(self, name)()
                counts[name] = counts.get(name, 0) + 1
                self.check()
            except Refused as e:
                counts["refused " + str(e)] = counts.get("refused " + str(e), 0) + 1
            except AssertionError as e:
                raise AssertionError(f"step {step} ({name}): {e}\nlast ops: {self.log[-12:]}") from e
        return counts
