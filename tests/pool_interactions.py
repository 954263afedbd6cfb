"""A seeded random driver of ``KVPool`` on CPU that mixes the features which meet
in the core: prefix hits, fork and copy-on-write, truncate (into registered and
shared pages), the host tier (write_back / write_through evictions, host hits,
swap_out / swap_in), retention priorities and pins on a manual clock, eviction
under pressure, KV events, and refused calls in the middle of all of it.

Every request's K/V at position p is a function of its salt and its true tokens
up to p (as a model's K/V is), so a page served for other tokens or another salt
reads back wrong. After every call the driver checks ``check()``, every open
request's table row and K/V, its known tokens, and that every page the drained
KV events say a tier holds really holds that content (the hash recomputed from
the events' chain, the bytes read from the device page or the host page).

The driver runs two pools built alike (same seeds) side by side. Every call that
succeeds is made on both; a call that is refused is made on the first only. A
refused call must leave its pool exactly as it was, hidden state included (free
stack order, LRU order, handle generations, events): so from then on the two
pools must keep answering every call identically.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from interactions_common import EventMirror, Faults, Injected, Refused, Req, make_prompt

import kvpool

LAYERS, H, D = 2, 1, 2


def rows_of(codes: list[int], positions: list[int]) -> list[torch.Tensor]:
    """Per layer, the (K, V) rows a model would write for these positions' codes."""
    c = torch.tensor(codes, dtype=torch.int64)
    lo, hi = (c & 0xFFFFF).float(), ((c >> 20) & 0xFFFFF).float()
    pos = torch.tensor(positions, dtype=torch.float32)
    out = []
    for layer in range(LAYERS):
        k = torch.stack([lo + layer * (1 << 20), pos], dim=1).view(-1, H, D)
        v = torch.stack([hi + layer * (1 << 20), -pos - 1], dim=1).view(-1, H, D)
        out.append((k, v))
    return out


def snapshot(pool: kvpool.KVPool, handles: list[int]) -> tuple:
    """Everything a refused call must leave as it was (hidden state is the twin's job)."""
    per = []
    for h in handles:
        if not pool.is_open(h):
            per.append((h, None))
            continue
        sw = pool.is_swapped(h)
        per.append((h, pool.length(h), sw, None if sw else pool.slots(h).tolist(), pool.known_tokens(h).tolist()))
    # Bitwise: never-written memory may hold NaN patterns, which torch.equal calls unequal.
    host = pool.host.buffer.clone().view(torch.int32) if pool.host is not None else None
    return (str(pool.stats()), pool.evictable_pages_by_priority().tolist(), per, pool.req_to_token.clone(),
            [c.clone().view(torch.int32) for c in pool._storage.caches], host)


def same_snapshot(a: tuple, b: tuple) -> bool:
    if a[:3] != b[:3] or not torch.equal(a[3], b[3]):
        return False
    if any(not torch.equal(x, y) for x, y in zip(a[4], b[4])):
        return False
    return (a[5] is None and b[5] is None) or torch.equal(a[5], b[5])


class Driver:
    def __init__(self, seed: int, page_size: int, num_pages: int, host_pages: int, policy: str,
                 layout: str = "token", device_table: bool = False, max_pinned: int | None = None,
                 faults: Faults | None = None) -> None:
        self.rng = random.Random(seed)
        self.P = page_size
        self.faults = faults  # device failures, on the device table path only
        kw = dict(dtype=torch.float32, page_size=page_size, num_pages=num_pages, max_requests=6,
                  max_context_len=8 * page_size + 5, layout=layout, hash_seed=seed + 11, handle_seed=seed + 13,
                  host_pages=host_pages, host_policy=policy, manual_clock=True, max_pinned_pages=max_pinned)
        self.pools = [kvpool.KVPool(LAYERS, H, D, **kw), kvpool.KVPool(LAYERS, H, D, **kw)]
        if device_table:  # the table path a device pool takes (packed update, written rows)
            for p in self.pools:
                p._table_np = None
        self.reqs: dict[int, Req] = {}
        self.closed: list[int] = []
        self.clock = 0.0
        self.mirror = EventMirror(page_size, seed + 11)
        systems = [[self.rng.randrange(4) for _ in range(self.rng.randrange(1, 3 * page_size + 2))]
                   for _ in range(3)]
        self.systems = systems
        self.log: list[str] = []
        self.seen: list[tuple[list[int], int]] = []  # prompts of requests cached so far

    # ----- calls -------------------------------------------------------------

    def both(self, name: str, fn):
        """Call fn(pool) on the first pool; if it succeeds, on the twin too, and
        compare results. A refusal must change nothing."""
        a, b = self.pools
        before = snapshot(a, list(self.reqs) + self.closed[-3:])
        at = self.rng.randrange(2) if self.faults is not None and self.rng.random() < 0.3 else None
        try:
            if self.faults is not None:
                self.faults.arm(at)
            ra = fn(a)
        except Injected:
            # Both pools fail alike, so they stay twins; the call is rolled back.
            self.faults.arm(at)
            try:
                fn(b)
            except Injected:
                raise Refused("injected device failure") from None
            raise AssertionError(f"{name}: the twin did not reach the injected failure") from None
        except kvpool.KVPoolError as e:
            after = snapshot(a, list(self.reqs) + self.closed[-3:])
            assert same_snapshot(before, after), f"{name} refused ({type(e).__name__}: {e}) but changed the pool"
            ev = a.take_events()
            assert len(ev["kind"]) == 0, f"{name} refused but recorded events"
            raise Refused(type(e).__name__) from e
        if self.faults is not None:
            self.faults.arm(None)
        rb = fn(b)
        assert repr(ra) == repr(rb), f"{name}: twin answered differently after a refusal: {ra!r} vs {rb!r}"
        return ra

    def write(self, h: int, slots: np.ndarray, start: int) -> None:
        r = self.reqs[h]
        n = len(slots)
        if n == 0:
            return
        pos = list(range(start, start + n))
        rows = rows_of(r.codes[start:start + n], pos)
        for p in self.pools:
            idx = torch.as_tensor(np.asarray(slots, dtype=np.int64))
            for layer, (k, v) in enumerate(rows):
                p.write(layer, idx, k, v)

    def new_tokens(self, r: Req, n: int) -> tuple[list[int], bool]:
        """n next tokens for r (the remembered prompt's where it reaches), and
        whether to tell the pool."""
        start = len(r.tokens)
        toks = []
        for i in range(n):
            j = start + i
            toks.append(r.prompt[j] if j < len(r.prompt) else self.rng.randrange(4))
        return toks, self.rng.random() < 0.85

    # ----- operations --------------------------------------------------------

    def op_open_prefix(self) -> None:
        k = self.rng.randrange(1, 3)
        prompts, salts = [], []
        for _ in range(k):
            prompt, salt = make_prompt(self.rng, self.systems, self.seen, self.P)
            prompts.append(prompt)
            salts.append(salt)
        flat = [t for p in prompts for t in p]
        lens = [len(p) for p in prompts]
        hs, cached = self.both("open_with_prefix",
                               lambda p: p.open_with_prefix(flat, lens, salts))
        for h, c, pr, s in zip(hs.tolist(), cached.tolist(), prompts, salts):
            assert 0 <= c <= len(pr) - 1, (c, len(pr))
            r = Req(s, prompt=list(pr))
            for t in pr[:c]:
                r.push(t, True)
            self.reqs[h] = r

    def op_open(self) -> None:
        hs = self.both("open", lambda p: p.open(1))
        self.reqs[int(hs[0])] = Req(0)

    def pick(self, swapped: bool | None = False) -> int | None:
        hs = [h for h, r in self.reqs.items() if swapped is None or r.swapped == swapped]
        return self.rng.choice(hs) if hs else None

    def op_extend(self) -> None:
        hs = [h for h, r in self.reqs.items() if not r.swapped]
        if self.rng.random() < 0.1 and any(r.swapped for r in self.reqs.values()):
            hs.append(self.pick(True))  # refused: swapped out
        if not hs:
            return
        batch = self.rng.sample(hs, self.rng.randrange(1, len(hs) + 1))
        counts = [self.rng.choice([1, 1, 2, self.P, self.P + 1, 3 * self.P]) for _ in batch]
        tok_lists, tell = [], self.rng.random() < 0.8
        clones = {h: self.reqs[h].clone() for h in batch}
        for h, c in zip(batch, counts):
            toks, _ = self.new_tokens(self.reqs[h], c)
            tok_lists.append(toks)
        flat = [t for ts in tok_lists for t in ts]
        if tell and flat and self.rng.random() < 0.05:
            flat[0] = (flat[0] + 1) % 4 + 4  # disagrees with a prompt or not: either is fine to try
            tok_lists[0] = [flat[0]] + tok_lists[0][1:]
        starts = [len(self.reqs[h].tokens) for h in batch]
        res = self.both("extend", lambda p: p.extend(batch, counts, tokens=flat if tell else None))
        off = 0
        for h, c, toks, s in zip(batch, counts, tok_lists, starts):
            r = clones[h]
            for j, t in enumerate(toks):
                pos = s + j
                in_prompt = pos < len(r.prompt)
                r.push(t, tell or in_prompt)
            self.reqs[h] = r
            self.write(h, res.slots[off:off + c], s)
            off += c

    def op_fork(self) -> None:
        h = self.pick(None)
        if h is None:
            return
        n = self.rng.randrange(1, 3)
        kids = self.both("fork", lambda p: p.fork(h, n))
        for k in kids.tolist():
            self.reqs[k] = self.reqs[h].clone()

    def some(self, swapped: bool | None = False) -> list[int]:
        """A few distinct handles (swapped or not; None: either)."""
        hs = [h for h, r in self.reqs.items() if swapped is None or r.swapped == swapped]
        return self.rng.sample(hs, self.rng.randrange(1, min(3, len(hs)) + 1)) if hs else []

    def op_truncate(self) -> None:
        hs = self.some(None)
        if not hs:
            return
        to = [self.rng.randrange(0, len(self.reqs[h].tokens) + 1) for h in hs]
        if self.rng.random() < 0.1:
            to[-1] = len(self.reqs[hs[-1]].tokens) + 1
        self.both("truncate", lambda p: p.truncate(hs, to))
        for h, n in zip(hs, to):
            self.reqs[h].cut(n)

    def op_cache(self) -> None:
        hs = self.some(None)
        if not hs:
            return
        pr = self.rng.choice([None, None, 0, 35, 80, 100, [self.rng.randrange(101) for _ in hs]])
        rs = self.rng.choice([None, 5.0]) if pr is not None else None
        self.both("cache", lambda p: p.cache(hs, priority=pr, retain_s=rs))
        self.seen += [(list(self.reqs[h].tokens), self.reqs[h].salt) for h in hs if self.reqs[h].tokens]

    def op_close(self) -> None:
        hs = self.some(None)
        if not hs:
            return
        cache = self.rng.random() < 0.7
        pr = self.rng.choice([None, None, 10, 100, [self.rng.randrange(101) for _ in hs]]) if cache else None
        self.both("close", lambda p: p.close(hs, cache=cache, priority=pr))
        if cache:
            self.seen += [(list(self.reqs[h].tokens), self.reqs[h].salt) for h in hs if self.reqs[h].tokens]
        for h in hs:
            del self.reqs[h]
            self.closed.append(h)

    def op_admit(self) -> None:
        k = self.rng.randrange(1, 3)
        news = [Req(0) for _ in range(k)]
        counts = [self.rng.randrange(0, 2 * self.P + 2) for _ in news]
        toks = [[self.rng.randrange(4) for _ in range(c)] for c in counts]
        tell = self.rng.random() < 0.8
        flat = [t for ts in toks for t in ts]
        hs, res = self.both("admit", lambda p: p.admit(counts, tokens=flat if tell else None))
        off = 0
        for h, r, c, ts in zip(hs.tolist(), news, counts, toks):
            for t in ts:
                r.push(t, tell)
            self.reqs[h] = r
            self.write(h, res.slots[off:off + c], 0)
            off += c

    def op_reset(self) -> None:
        self.both("reset", lambda p: p.reset())
        self.closed += list(self.reqs)
        self.reqs.clear()

    def op_stale(self) -> None:
        if not self.closed:
            return
        h = self.rng.choice(self.closed)
        name = self.rng.choice(["extend", "close", "fork", "cache", "truncate"])
        calls = {"extend": lambda p: p.extend([h], 1), "close": lambda p: p.close([h]),
                 "fork": lambda p: p.fork(h), "cache": lambda p: p.cache([h]),
                 "truncate": lambda p: p.truncate([h], [0])}
        self.both(name, calls[name])
        raise AssertionError(f"{name} of a closed handle was accepted")

    def op_evict(self) -> None:
        n = self.rng.randrange(0, 4)
        self.both("evict", lambda p: p.evict(n))

    def op_swap_out(self) -> None:
        hs = self.some(False if self.rng.random() < 0.9 else None)
        if not hs:
            return
        self.both("swap_out", lambda p: p.swap_out(hs))
        for h in hs:
            self.reqs[h].swapped = True

    def op_swap_in(self) -> None:
        hs = self.some(True if self.rng.random() < 0.9 else None)
        if not hs:
            return
        self.both("swap_in", lambda p: p.swap_in(hs))
        for h in hs:
            self.reqs[h].swapped = False

    def op_unpin(self) -> None:
        h = self.pick(None)
        if h is not None:
            self.both("unpin", lambda p: p.unpin([h]))

    def op_clock(self) -> None:
        self.clock += self.rng.choice([1.0, 3.0, 6.0])
        self.both("set_clock", lambda p: p.set_clock(self.clock))

    def op_clear(self) -> None:
        self.both("clear_cache", lambda p: p.clear_cache())

    OPS = [("op_open_prefix", 6), ("op_open", 1), ("op_extend", 10), ("op_fork", 2), ("op_truncate", 3),
           ("op_cache", 3), ("op_close", 4), ("op_stale", 1), ("op_evict", 2), ("op_swap_out", 2),
           ("op_swap_in", 2), ("op_unpin", 1), ("op_clock", 1), ("op_clear", 0.3),
           ("op_admit", 2), ("op_reset", 0.1)]

    # ----- checks ------------------------------------------------------------

    def events(self) -> None:
        self.mirror.apply_twins(*self.pools)

    def check(self) -> None:
        a = self.pools[0]
        for p in self.pools:
            p.check()
            assert p.allocator.pending_offloads == 0 and p.allocator.pending_loads == 0
        self.events()
        P = self.P
        for h, r in self.reqs.items():
            assert a.length(h) == len(r.tokens), (h, a.length(h), len(r.tokens))
            assert a.is_swapped(h) == r.swapped
            assert a.known_tokens(h).tolist() == r.known(), (a.known_tokens(h).tolist(), r.known())
            if r.swapped or not r.tokens:
                continue
            slots = a.slots(h)
            row = int(a.rows([h])[0])
            assert a.req_to_token[row, : len(slots)].tolist() == slots.tolist(), "table row disagrees"
            want = rows_of(r.codes, list(range(len(r.codes))))
            for layer in range(LAYERS):
                k, v = a.read(layer, slots)
                bad = ~((k == want[layer][0]).all(-1).all(-1) & (v == want[layer][1]).all(-1).all(-1))
                assert not bad.any(), f"request {h}: wrong K/V at positions {bad.nonzero().view(-1).tolist()[:8]}"
        for med, page, toks, codes in self.mirror.pages():
            want = rows_of(codes, list(range(len(toks) - P, len(toks))))
            for layer in range(LAYERS):
                if med == 0:
                    k, v = a.read(layer, list(range(page * P, page * P + P)))
                else:
                    k, v = a.host.buffer[page, 0, layer], a.host.buffer[page, 1, layer]
                assert torch.equal(k, want[layer][0]) and torch.equal(v, want[layer][1]), (
                    f"events say medium {med} page {page} holds {toks}, its bytes differ")

    def run(self, steps: int) -> dict[str, int]:
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        counts: dict[str, int] = {}
        for step in range(steps):
            name = self.rng.choices(names, weights)[0]
            if name in ("op_swap_out", "op_swap_in") and self.pools[0].host is None:
                continue
            if name in ("op_open_prefix", "op_open", "op_admit") and len(self.reqs) >= 6 and self.rng.random() < 0.7:
                name = "op_close"
            self.log.append(name)
            try:
                getattr(self, name)()
                counts[name] = counts.get(name, 0) + 1
            except Refused as e:
                counts["refused " + str(e)] = counts.get("refused " + str(e), 0) + 1
            except AssertionError as e:
                raise AssertionError(f"step {step} ({name}): {e}\nlast ops: {self.log[-12:]}") from e
            try:
                self.check()
            except AssertionError as e:
                raise AssertionError(f"after step {step} ({name}): {e}\nlast ops: {self.log[-12:]}") from e
        return counts
