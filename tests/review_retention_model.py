"""An outside reference model of retention priorities for a SlotAllocator
(docs/allocator.md, Retention priorities), written apart from the pool's own
models: it reads registrations from the KV events and holders from ``pages()``,
and keeps per device page only its priority, end and LRU stamp. Eviction takes
the lowest priority first, then the least recently used page (a request releases
its pages last first, so a chain's tail is older). Used by
test_review_retention_order.py at page sizes 1 and 16 with multi-page chains,
prefix sharing, forks and truncates."""

from __future__ import annotations

import numpy as np

import kvpool
from kvpool._core import page_hashes

D = kvpool.DEFAULT_PRIORITY
PIN = 101  # the pinned list: priority 100 with no end


class Retention:
    def __init__(self, a: kvpool.SlotAllocator, max_pinned: int) -> None:
        self.a, self.P, self.max_pinned = a, a.page_size, max_pinned
        self.reg: dict[int, tuple[int, int]] = {}  # device page -> chain hash
        self.where: dict[tuple[int, int], int] = {}  # chain hash -> device page
        self.rid: dict[int, int] = {}  # device page -> registration id (a take-over keeps it)
        self.prio: dict[int, list] = {}  # page -> [priority, end or None, order its end was given]
        self.stamp: dict[int, int] = {}  # page -> when it last joined its LRU list
        self.refs: dict[int, list[int]] = {}  # handle -> registration ids of its cached prefix
        self.handles: list[int] = []
        self.tick = self.seq = self.nrid = 0
        self.clock = 0.0
        self.evicted = self.pressure = self.takeovers = 0

    def t(self) -> int:
        self.tick += 1
        return self.tick

    def plist(self, p: int) -> int:
        x = self.prio.get(p)
        return D if x is None else PIN if x[0] == 100 and x[1] is None else x[0]

    def held(self) -> set[int]:
        return {int(x) for h in self.handles for x in self.a.pages(h)}

    def victims(self, held: set[int]) -> list[int]:
        return [p for _, _, p in sorted((self.plist(p), self.stamp[p], p) for p in self.reg
                                        if p not in held and self.plist(p) != PIN)]

    def by_priority(self, held: set[int]) -> list[int]:
        out = [0] * 101
        for p in self.reg:
            if p not in held and self.plist(p) != PIN:
                out[self.plist(p)] += 1
        return out

    def pinned(self) -> int:
        return sum(self.plist(p) == PIN for p in self.reg)

    def absorb(self, held_before: set[int], held_after: set[int]) -> list[int]:
        """The call's device events: returns the pages evicted, in order. A Removed whose
        hash is Stored again in the same call is a take-over (the new page takes the
        registration and its priority, the end filed as if given now); one of a page held
        before the call is a rewrite in place."""
        ev = self.a.take_events()
        keys = [(int(x), int(y)) for x, y in zip(ev["hash_hi"], ev["hash_lo"])]
        dev = [i for i in range(len(keys)) if ev["medium"][i] == 0]
        stored = {keys[i] for i in dev if ev["kind"][i] == 0}
        moved: dict[tuple[int, int], tuple] = {}
        evicted = []
        for i in dev:
            p, key, kind = int(ev["page"][i]), keys[i], int(ev["kind"][i])
            if kind == 0:
                self.reg[p], self.where[key] = key, p
                old = moved.pop(key, None)
                if old is None:
                    self.nrid += 1
                    self.rid[p] = self.nrid
                    self.prio.pop(p, None)
                else:
                    self.rid[p], prio = old
                    self.takeovers += 1
                    if prio is not None and prio[1] is not None:
                        self.seq += 1
                        prio = [prio[0], prio[1], self.seq]
                    if prio is not None:
                        self.prio[p] = prio
                self.stamp.setdefault(p, self.t())
            elif kind == 1:
                del self.reg[p]
                if self.where.get(key) == p:
                    del self.where[key]
                prio, r = self.prio.pop(p, None), self.rid.pop(p)
                self.stamp.pop(p, None)
                if key in stored and p not in held_after:
                    moved[key] = (r, prio)
                elif p not in held_before and key not in stored:
                    evicted.append(p)
            else:
                raise AssertionError("no call here clears the cache")
        return evicted

    def released(self, order: list[int], held_after: set[int]) -> None:
        for p in order:
            if p in self.reg and p not in held_after:
                self.stamp[p] = self.t()

    def content_prefix(self, tokens: np.ndarray) -> list[int]:
        """The device pages a verified lookup of these tokens reaches (the pool's own
        match_chain_hashes says where an orphan stops it)."""
        n = len(tokens) // self.P
        hs = page_hashes(np.asarray(tokens[: n * self.P], dtype=np.int64), self.P, self.a.hash_seed)
        n = min(n, self.a.match_chain_hashes(hs[: 2 * n], np.asarray(tokens[: n * self.P])))
        out = []
        for i in range(n):
            p = self.where.get((int(hs[2 * i]), int(hs[2 * i + 1])))
            if p is None:
                break
            out.append(p)
        return out

    def set_refs(self, h: int, pages: list[int]) -> None:
        self.refs[h] = [self.rid[p] for p in pages]

    def cached_prefix(self, h: int) -> list[int]:
        """What cache() last walked for h (its own registrations or the kept copies of the
        content it duplicated), up to the first that went."""
        live = {r: p for p, r in self.rid.items()}
        out = []
        for r in self.refs.get(h, []):
            if r not in live:
                break
            out.append(live[r])
        return out

    def give(self, pages: list[int], q: int, retain: float | None, held: set[int]) -> None:
        end = None if retain is None else self.clock + retain
        inf = float("inf")
        for p in pages:
            old, qq, cur = self.plist(p), q, self.prio.get(p)
            if qq == 100 and end is None and old != PIN and self.pinned() >= self.max_pinned:
                qq = 99  # a pin past the bound
            if cur is not None and not (qq > cur[0] or (qq == cur[0] and (inf if end is None else end)
                                                        > (inf if cur[1] is None else cur[1]))):
                continue  # a lower priority while a higher one holds is not remembered
            if end is not None and (cur is None or cur[1] != end):
                self.seq += 1
                seq = self.seq
            else:
                seq = cur[2] if cur is not None else 0
            self.prio[p] = [qq, end, seq]
            if old != self.plist(p) and p not in held:
                self.stamp[p] = self.t()

    def unpin(self, pages: list[int], held: set[int]) -> int:
        n = 0
        for p in pages:
            if self.plist(p) == PIN:
                del self.prio[p]
                n += 1
                if p not in held:
                    self.stamp[p] = self.t()
        return n

    def set_clock(self, now: float, held: set[int]) -> None:
        """Ends due end soonest first, the latest given first among equal ends, so a
        chain's tail (given last) rejoins the default list older than its parents."""
        self.clock = now
        for _, _, p in sorted((x[1], -x[2], p) for p, x in self.prio.items() if x[1] is not None and x[1] <= now):
            old = self.plist(p)
            del self.prio[p]
            if old != D and p not in held:
                self.stamp[p] = self.t()


def prompt(rng: np.random.Generator, P: int) -> np.ndarray:
    """A system prompt (one of three, 1.5 pages and more) and up to two shared turns."""
    parts = [np.arange(1000 * s, 1000 * s + int(1.5 * P) + s) for s in [int(rng.integers(3))]]
    for t in rng.integers(0, 4, int(rng.integers(0, 3))):
        parts.append(np.arange(50000 + 100 * int(t), 50000 + 100 * int(t) + P + int(t)))
    return np.concatenate(parts).astype(np.int64)


def run(seed: int, P: int, num_pages: int, max_pinned: int, steps: int = 300) -> Retention:
    rng = np.random.default_rng(seed)
    a = kvpool.SlotAllocator(num_pages, P, 8, 256, hash_seed=1, manual_clock=True, max_pinned_pages=max_pinned)
    m = Retention(a, max_pinned)
    for step in range(steps):
        held0 = m.held()
        before = m.victims(held0)
        r, op, released, h, q, retain, toks = rng.random(), None, [], None, None, None, None
        try:
            if r < 0.3 and len(m.handles) < 8:
                op, t = "open", prompt(rng, P)
                hs, c = a.open_with_prefix(t, [len(t)])
                h = int(hs[0])
                m.handles.append(h)
                m.set_refs(h, [int(x) for x in a.pages(h)[: int(c[0]) // P]])
                try:
                    a.extend(hs, [len(t) - int(c[0])], tokens=t[int(c[0]):])
                except kvpool.PoolExhaustedError:
                    released = [int(x) for x in a.pages(h)][::-1]
                    a.close(hs)
                    m.handles.remove(h)
            elif r < 0.38 and m.handles and len(m.handles) < 8:
                op, par = "fork", m.handles[int(rng.integers(len(m.handles)))]
                h = int(a.fork(par, 1)[0])
                m.handles.append(h)
                m.refs[h] = list(m.refs.get(par, []))
            elif r < 0.48 and m.handles:
                op, h = "truncate", m.handles[int(rng.integers(len(m.handles)))]
                old = [int(x) for x in a.pages(h)]
                n = int(rng.integers(0, a.length(h) + 1))
                a.truncate([h], [n])
                released = old[len(a.pages(h)):][::-1]
                refs, full, live = m.refs.get(h, []), n // P, set(m.rid.values())
                # A truncation into the chain resumes it at the last page kept: its own
                # registration, or where it duplicated content, the kept copy while every
                # registration the chain went through is still live; otherwise the chain
                # restarts (its cached prefix is empty until the next cache():
                # docs/allocator.md).
                kept = full and (old[full - 1] in m.rid or all(x in live for x in refs))
                m.refs[h] = refs[:full] if len(refs) <= full or kept else []
            elif r < 0.56 and m.handles:
                op, h = "extend", m.handles[int(rng.integers(len(m.handles)))]
                n = int(rng.integers(1, 2 * P + 1))
                a.extend([h], [n], tokens=rng.integers(0, 3, n) + 90000)
            elif r < 0.64 and m.handles:
                op, h = "cache", m.handles[int(rng.integers(len(m.handles)))]
                q = int(rng.choice([0, 10, D, 60, 99, 100, 100]))
                retain = None if rng.random() < 0.6 else float(rng.integers(1, 4))
                a.cache([h], priority=q, retain_s=retain)
            elif r < 0.67 and m.handles:
                op, h = "unpin", m.handles[int(rng.integers(len(m.handles)))]
                unpinned = a.unpin([h])
            elif r < 0.85 and m.handles:
                op, h = "close", m.handles.pop(int(rng.integers(len(m.handles))))
                released, toks = [int(x) for x in a.pages(h)][::-1], a.known_tokens(h)
                if rng.random() < 0.6:
                    q = int(rng.choice([0, 10, D, 60, 99, 100, 100]))
                    retain = None if rng.random() < 0.6 else float(rng.integers(1, 4))
                a.close([h], cache=bool(q is not None or rng.random() < 0.8), priority=q, retain_s=retain)
            elif r < 0.93:
                op, n = "evict", int(rng.integers(1, 4))
                got = a.evict(n)
            else:
                op = "clock"
                a.set_clock(m.clock + 1)
        except (kvpool.PoolExhaustedError, kvpool.TooManyRequestsError, kvpool.ContextTooLongError):
            pass
        a.take_copies()
        held = m.held()
        evicted = m.absorb(held0, held)
        expected = [p for p in before if p not in held or p in evicted]
        where = (seed, P, step, op)
        assert evicted == expected[: len(evicted)], (where, evicted, expected)
        m.evicted += len(evicted)
        m.pressure += len(evicted) if op != "evict" else 0
        if op == "evict":
            assert got == min(n, len(expected)), (where, got, n)
        if op == "cache":
            m.set_refs(h, m.content_prefix(a.known_tokens(h)))
            m.give(m.cached_prefix(h), q, retain, held)
        elif op == "close" and q is not None:
            m.give(m.content_prefix(toks), q, retain, held0)  # given before the pages are released
        m.released(released, held)
        m.released(sorted(held0 - held - set(released)), held)  # queued copies' sources
        if op == "unpin":
            assert unpinned == m.unpin(m.cached_prefix(h), held), where
        elif op == "clock":
            m.set_clock(m.clock + 1, held)
        assert a.evictable_pages_by_priority().tolist() == m.by_priority(held), where
        assert a.pinned_pages == m.pinned(), where
        if step % 50 == 0:
            a.check()
    a.check()
    return m
