"""Take-overs (a recomputed page takes an unheld copy's registration, which goes
FREE) and orphan replacements (an entry whose parent registration is gone gives way
to the recomputed page) under random call sequences, checked on content.

Each slot's simulated K/V is a code of its whole prefix and salt, not of its token
alone, so a page that serves another prefix's K/V fails even where the tokens at
its positions agree. The engine drives SlotAllocator directly and drains the queues
lazily: only before a step's writes (offloads, loads, then copies), so a page a
take-over freed while a queued transfer still names it is handed out again in
between. After each step every open request reads its own prefix's codes, and
every page the KV events say is cached (either tier) holds the codes of the chain
the events describe."""

from __future__ import annotations

import random

import numpy as np
import pytest
from interactions_common import EventMirror, next_code, root

import kvpool

SEED = 11
CTX = 40
STORED, REMOVED = 0, 1


def codes(tokens, salt):
    c, out = root(salt), []
    for t in tokens:
        c = next_code(c, t)
        out.append(c)
    return out


class Engine:
    def __init__(self, seed, ps, host_pages, policy):
        self.rng = random.Random(seed)
        kw = {"host_pages": host_pages, "host_policy": policy} if host_pages else {}
        self.ps = ps
        n = 14 if ps < 16 else 9
        self.a = kvpool.SlotAllocator(n, ps, 8, CTX, hash_seed=SEED, handle_seed=seed, **kw)
        self.dev = np.zeros(n * ps, dtype=np.int64)
        self.host = np.zeros(max(host_pages, 1) * ps, dtype=np.int64)
        self.mirror = EventMirror(ps, SEED)
        self.bases = [[self.rng.randrange(5) for _ in range(CTX)] for _ in range(3)]
        self.reqs: dict[int, tuple[list[int], int]] = {}  # handle -> (its tokens to come, salt)
        self.take_overs = 0

    def settle(self):
        """After each call: the pool is consistent and its events are mirrored."""
        self.a.check()
        ev = self.a.take_events()
        removed: set[tuple] = set()
        for k, hi, lo, m in zip(ev["kind"], ev["hash_hi"], ev["hash_lo"], ev["medium"]):
            key = (int(hi), int(lo), int(m))
            if k == REMOVED:
                removed.add(key)
            elif k == STORED and key in removed:
                self.take_overs += 1
        self.mirror.apply(ev)

    def drain(self):
        a, ps = self.a, self.ps
        for d, h in zip(*a.take_offloads()):
            self.host[h * ps:(h + 1) * ps] = self.dev[d * ps:(d + 1) * ps]
        for h, d in zip(*a.take_loads()):
            self.dev[d * ps:(d + 1) * ps] = self.host[h * ps:(h + 1) * ps]
        for s, d in zip(*a.take_copies()):
            self.dev[d] = self.dev[s]

    def verify(self):
        self.drain()
        a, ps = self.a, self.ps
        for h, (tokens, salt) in self.reqs.items():
            if a.is_swapped(h):
                continue
            n = a.length(h)
            assert self.dev[a.slots(h)].tolist() == codes(tokens[:n], salt), f"request {h:#x} reads another prefix"
        assert len(self.mirror.on_tier[0]) == a.cached_pages
        for med, page, _, want in self.mirror.pages():
            store = self.dev if med == 0 else self.host
            assert store[page * ps:(page + 1) * ps].tolist() == want, f"cached page {page} (medium {med})"

    def step(self, h, n):
        """Extend `h` by n of its tokens, then run the step: drain, write, check."""
        tokens, salt = self.reqs[h]
        at = self.a.length(h)
        self.a.extend([h], [n], tokens=tokens[at:at + n])
        self.settle()
        self.drain()
        slots = self.a.slots(h)[at:at + n]
        self.dev[slots] = codes(tokens[:at + n], salt)[at:]
        self.verify()

    def op(self):
        a, rng = self.a, self.rng
        live = [h for h in self.reqs if not a.is_swapped(h)]
        r = rng.random()
        if r < 0.2 and len(self.reqs) < 7:
            base, n, salt = rng.choice(self.bases), rng.randrange(1, CTX), rng.choice([0, 0, 5])
            hs, _ = a.open_with_prefix(base[:n], [n], salt=[salt])
            self.reqs[int(hs[0])] = (base[:n] + [rng.randrange(5) for _ in range(CTX - n)], salt)
        elif r < 0.3 and len(self.reqs) < 7:
            # No lookup: its pages recompute what may be cached already.
            self.reqs[int(a.open(1)[0])] = (list(rng.choice(self.bases)), 0)
        elif r < 0.55 and live:
            h = rng.choice(live)
            n = min(rng.randrange(1, 3 * self.ps + 2), CTX - a.length(h))
            if n > 0:
                self.step(h, n)
                return
        elif r < 0.65 and live:
            a.cache([rng.choice(live)], priority=rng.choice([None, 0, 60, 100]))
        elif r < 0.73 and live:
            h = rng.choice(live)
            a.close([h], cache=rng.random() < 0.7)
            del self.reqs[h]
        elif r < 0.83 and live:
            # Back into the request's pages, to recompute them: a page it alone
            # holds is written in place, and the pages after it become orphans.
            h = rng.choice(live)
            a.truncate([h], [rng.randrange(0, a.length(h) + 1)])
        elif r < 0.89 and live and len(self.reqs) < 7:
            h = rng.choice(live)
            self.reqs[int(a.fork(h, 1)[0])] = self.reqs[h]
        elif r < 0.93 and self.reqs and a.host_pages:
            h = rng.choice(list(self.reqs))
            if a.is_swapped(h):
                a.swap_in([h])
            else:
                a.swap_out([h])
        else:
            a.evict(rng.randrange(1, 4))
        self.settle()


@pytest.mark.parametrize("ps", [1, 2, 16])
@pytest.mark.parametrize("host", [(0, "write_back"), (6, "write_back"), (3, "write_back"), (6, "write_through")])
def test_every_hit_and_cached_page_holds_its_prefix_through_take_overs(ps, host):
    take_overs = 0
    for seed in range(12):
        e = Engine(seed, ps, *host)
        for _ in range(250):
            try:
                e.op()
            except (kvpool.PoolExhaustedError, kvpool.TooManyRequestsError):
                e.settle()
        e.verify()
        take_overs += e.take_overs
    assert take_overs > 0, "no call took over a registration: the sequences miss the rule under test"
