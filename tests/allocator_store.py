"""The hypothesis state machine's simulated K/V store (test_allocator_stateful.py):
every device and host slot holds the id of the content it carries, the queued
transfers run on it in the documented order (offloads, loads, copies), and each
request must read exactly what it wrote or was served.

A position's content is a pure function of what a model computes there: the salt
and the token ids of positions 0..i (or, where one is unknown, a write id of its
own). So a hit on a page computed for other tokens, a host copy overwritten before
its load ran, or a page offloaded before its load or copy filled it, shows up as a
wrong id. The store's engine writes a step's positions after running every queued
transfer that touches them, and otherwise leaves transfers queued across calls;
FREE pages no queued transfer touches get junk, as if another writer had used them.
"""

import itertools

from allocator_model_tier import HOST

_ids = itertools.count(1)


def content(salt, ctx):
    return hash((salt, tuple(ctx))) & ((1 << 62) - 1)


def junk():
    return (1 << 62) | next(_ids)


class Store:
    def __init__(self, num_pages, host_pages, ps):
        self.ps = ps
        self.dev = [junk() for _ in range(num_pages * ps)]
        self.host = [junk() for _ in range(max(host_pages, 1) * ps)]
        self.want = {}  # handle -> content per position (None: not written)

    def run(self, offloads, loads, copies):
        ps = self.ps
        for d, h in zip(*offloads):
            self.host[h * ps : (h + 1) * ps] = self.dev[d * ps : (d + 1) * ps]
        for h, d in zip(*loads):
            self.dev[d * ps : (d + 1) * ps] = self.host[h * ps : (h + 1) * ps]
        for s, t in zip(*copies):
            self.dev[t] = self.dev[s]

    def queued(self, m):
        """The model's queued transfers (equal to the allocator's: each drain compares them)."""
        t = m.tier
        offloads = ([d for d, _ in t.offloads], [h for _, h in t.offloads]) if t else ([], [])
        loads = ([h for h, _ in t.loads], [d for _, d in t.loads]) if t else ([], [])
        src = [c[0] * self.ps + j for c in m.queue for j in range(c[2])]
        dst = [c[1] * self.ps + j for c in m.queue for j in range(c[2])]
        return offloads, loads, (src, dst)

    def settled(self, m):
        s = Store.__new__(Store)
        s.ps, s.dev, s.host = self.ps, list(self.dev), list(self.host)
        s.run(*self.queued(m))
        return s

    def touched(self, m, slot):
        p, o = divmod(slot, self.ps)
        if any((c[0] == p or c[1] == p) and o < c[2] for c in m.queue):
            return True
        t = m.tier
        return t is not None and (any(x[0] == p for x in t.offloads) or any(x[1] == p for x in t.loads))

    # ---- what requests must read

    def hit(self, m, h, n):
        r = m.reqs[m.row(h)]
        self.want[h] = [content(r.salt, r.prompt[: i + 1]) for i in range(n)]

    def fork(self, parent, kids):
        for k in kids:
            self.want[k] = list(self.want.get(parent, []))

    def truncate(self, h, n):
        if h in self.want:
            del self.want[h][n:]

    def write(self, m, hs, drain):
        """The step of requests hs (those open on the device): after `drain()` if a
        queued transfer touches a slot it writes."""
        todo = []
        for h in hs:
            r = m.row(h)
            if r is None or m.reqs[r].swapped:
                continue
            q = m.reqs[r]
            w = self.want.setdefault(h, [])
            del w[len(q.tokens):]
            w.extend([None] * (len(q.tokens) - len(w)))
            slots = m.slots(r)
            for i, _t in enumerate(q.tokens):
                if w[i] is None:
                    ctx = q.tokens[: i + 1]
                    w[i] = content(q.salt, ctx) if None not in ctx else junk()
                    todo.append((slots[i], w[i]))
        if any(self.touched(m, s) for s, _ in todo):
            drain()
        for s, c in todo:
            self.dev[s] = c

    def scribble(self, m):
        ps = self.ps
        for p in m.free:
            if not any(self.touched(m, p * ps + o) for o in range(ps)):
                self.dev[p * ps : (p + 1) * ps] = [junk() for _ in range(ps)]
        t = m.tier
        if t is not None:
            for h in t.free:
                if not any(x[1] == h for x in t.offloads) and not any(x[0] == h for x in t.loads):
                    self.host[h * ps : (h + 1) * ps] = [junk() for _ in range(ps)]

    def verify(self, m):
        s = self.settled(m)
        ps = self.ps
        for h, w in self.want.items():
            r = m.row(h)
            if r is None:
                continue
            pages = m.reqs[r].pages
            for i, c in enumerate(w):
                if c is None:
                    continue
                loc = pages[i // ps]
                got = s.host[(loc & ~HOST) * ps + i % ps] if loc & HOST else s.dev[loc * ps + i % ps]
                assert got == c, f"request {h:#x} position {i} (page {loc:#x}) reads {got:#x}, must read {c:#x}"
