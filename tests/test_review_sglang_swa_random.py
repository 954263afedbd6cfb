"""Random traffic on a GroupedAllocator (full, sliding-window and state groups: SGLang's
SWARadixCache and MambaRadixCache cases) with a content oracle per group, checked after every call:

- every position a request attends to (all of a full group's, a sliding group's last window) holds
  the K/V its own prefix wrote, and a state group's live slot holds the state at its length
  (copies on write, checkpoints and restores move the oracle's tags as the queues say);
- `evict(group, n)` frees min(n, evictable) of that group, and never a held page;
- each group's held + free pages are its capacity, evictable <= cached;
- a refused call (PoolExhaustedError, RollbackUnavailableError) changes no group.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvpool

SYSTEMS = [list(range(1000, 1020)), list(range(2000, 2010))]
ZERO = ("zero",)


class SwaSim:
    def __init__(self, seed: int, sliding_page: int, window: int, full_page: int = 4, every: int = 0):
        self.rng = np.random.default_rng(seed)
        self.g = kvpool.GroupedAllocator(
            [{"kind": "full", "num_pages": 96 // full_page + 1, "page_size": full_page},
             {"kind": "sliding", "num_pages": 25, "page_size": sliding_page, "window": window},
             {"kind": "state", "num_slots": 24, "checkpoint_every": every}],
            max_requests=4, max_context_len=64, hash_seed=seed, handle_seed=seed)
        self.window = window
        self.tag: list[dict[int, tuple]] = [{}, {}, {}]
        self.reqs: dict[int, tuple[int, list[int]]] = {}

    def key(self, h: int, n: int) -> tuple:
        salt, toks = self.reqs[h]
        return (salt, tuple(toks[:n])) if n else ZERO

    def sync(self) -> None:
        for gi in range(3):
            src, dst = self.g.take_copies(gi)
            if gi == 2:  # one parallel copy: no slot of the batch is both read and written
                vals = [ZERO if s < 0 else self.tag[2].get(s) for s in src.tolist()]
                for d, v in zip(dst.tolist(), vals):
                    self.tag[2][d] = v
            else:
                for s, d in zip(src.tolist(), dst.tolist()):
                    self.tag[gi][d] = self.tag[gi].get(s)

    def write(self, hs: list[int], starts: list[int], counts: list[int], new: list[np.ndarray]) -> None:
        self.sync()
        for gi in (0, 1):
            off = 0
            for h, s0, n in zip(hs, starts, counts):
                for i, slot in enumerate(new[gi][off: off + n].tolist()):
                    self.tag[gi][slot] = self.key(h, s0 + i + 1)
                off += n
        for h, s0, n in zip(hs, starts, counts):
            if n:
                self.tag[2][int(self.g.state_slots([h], 2)[0])] = self.key(h, s0 + n)

    def verify(self) -> None:
        g = self.g
        g.check()
        for gi in range(3):
            assert g.evictable_pages(gi) <= g.cached_pages(gi)
            assert g.cached_pages(gi) - g.evictable_pages(gi) <= g.used_pages(gi), "protected pages are held"
            assert g.used_pages(gi) + g.free_pages(gi) == g.capacity_pages(gi)
        for h in self.reqs:
            n = g.length(h)
            assert n == len(self.reqs[h][1])
            for i, slot in enumerate(g.slots(h, 0).tolist()):
                assert self.tag[0].get(slot) == self.key(h, i + 1), ("full", h, i)
            pages = g.pages(h, 1)
            P = g.groups[1]["page_size"]
            for i, slot in enumerate(g.slots(h, 1).tolist()):
                if i >= n - self.window + 1:
                    assert pages[i // P] != 0, ("window released", h, i)
                if pages[i // P] != 0:
                    assert self.tag[1].get(slot) == self.key(h, i + 1), ("sliding", h, i)
            assert self.tag[2].get(int(g.state_slots([h], 2)[0])) == self.key(h, n), ("state", h)

    def refused(self, call, kinds=(kvpool.PoolExhaustedError,)) -> bool:
        g = self.g
        before = (g.stats(), {h: g.length(h) for h in self.reqs}, [g.pending_copies(i) for i in range(3)])
        try:
            call()
        except kinds:
            assert (g.stats(), {h: g.length(h) for h in self.reqs},
                    [g.pending_copies(i) for i in range(3)]) == before, "a refused call changed the pool"
            return True
        return False

    def open(self) -> None:
        if len(self.reqs) >= self.g.max_requests:
            return
        rng = self.rng
        base = SYSTEMS[rng.integers(len(SYSTEMS))]
        prompt = base[: 4 * rng.integers(1, len(base) // 4 + 1)] + rng.integers(0, 4, rng.integers(1, 10)).tolist()
        salt = int(rng.integers(0, 2))
        out = []
        if self.refused(lambda: out.append(self.g.open_with_prefix(np.array(prompt), [len(prompt)], salt=salt))):
            return
        h, c = int(out[0][0][0]), int(out[0][1][0])
        assert c <= len(prompt) - 1 and c % self.g.hit_step == 0
        self.reqs[h] = (salt, prompt[:c])
        self.sync()
        self.verify()  # the hit serves this prompt's prefix in every group
        self.reqs[h] = (salt, prompt)
        # Chunked prefill in chunks of the hit step, caching after each (SGLang's
        # cache_unfinished_req): a state checkpoint needs the length on a multiple of it.
        step = self.g.hit_step
        bounds = [c] + list(range(c + step, len(prompt), step)) + [len(prompt)]
        for start, end in zip(bounds, bounds[1:]):
            res = []
            if self.refused(lambda: res.append(self.g.extend([h], [end - start]))):
                self.g.close([h], cache=True)  # it keeps its prompt: later tokens would have to be the prompt's
                del self.reqs[h]
                return
            self.write([h], [start], [end - start], res[0])
            if end % step == 0:
                self.g.cache([h])

    def decode(self) -> None:
        if not self.reqs:
            return
        hs = [h for h in self.reqs if self.rng.random() < 0.6] or list(self.reqs)[:1]
        starts = [self.g.length(h) for h in hs]
        counts = [min(int(self.rng.integers(1, 4)), self.g.max_context_len - s) for s in starts]
        new = [self.rng.integers(0, 4, k).tolist() for k in counts]
        old = {h: self.reqs[h] for h in hs}
        for h, s0, t in zip(hs, starts, new):
            self.reqs[h] = (old[h][0], old[h][1][:s0] + t)
        res = []
        if self.refused(lambda: res.append(self.g.extend(hs, counts, tokens=np.array(sum(new, []), dtype=np.int64)))):
            self.reqs.update(old)
            return
        self.write(hs, starts, counts, res[0])

    def step(self) -> None:
        g, rng = self.g, self.rng
        op = rng.choice(["open", "open", "decode", "decode", "close", "cache", "evict", "fork", "truncate"])
        hs = list(self.reqs)
        h = hs[rng.integers(len(hs))] if hs else None
        if op == "open":
            self.open()
        elif op == "decode":
            self.decode()
        elif op == "close" and h is not None:
            g.close([h], cache=bool(rng.random() < 0.8))
            del self.reqs[h]
        elif op == "cache" and h is not None:
            g.cache([h])
        elif op == "evict":
            gi, n = int(rng.integers(3)), int(rng.integers(0, 6))
            expect = min(n, g.evictable_pages(gi))
            assert g.evict(gi, n) == expect, "evict frees min(n, evictable)"
        elif op == "fork" and h is not None and len(self.reqs) < g.max_requests:
            out = []
            if not self.refused(lambda: out.append(g.fork(h, 1))):
                self.reqs[int(out[0][0])] = (self.reqs[h][0], list(self.reqs[h][1]))
        elif op == "truncate" and h is not None:
            n = int(rng.integers(0, g.length(h) + 1))
            if not self.refused(lambda: g.truncate([h], [n]), (kvpool.RollbackUnavailableError,
                                                             kvpool.PoolExhaustedError)):
                salt, toks = self.reqs[h]
                self.reqs[h] = (salt, toks[:n])
        self.sync()
        self.verify()


# (2, 6, 4, 0): no full page size divides the sliding one, so a token-only anchor chain proves
# hits; (4, 8, 2, 8): the full group is the anchor, and evicting it orphans the other groups' pages.
@pytest.mark.parametrize("sliding_page,window,full_page,every", [(2, 6, 4, 0), (4, 8, 4, 0), (1, 3, 4, 0),
                                                                 (4, 8, 2, 8)])
@pytest.mark.parametrize("seed", range(5))
def test_random_swa_and_state_traffic(seed, sliding_page, window, full_page, every):
    sim = SwaSim(seed, sliding_page, window, full_page, every)
    for _ in range(250):
        sim.step()
    sim.g.reset()
    sim.reqs.clear()
    sim.sync()
    sim.verify()
    assert [sim.g.used_pages(i) for i in range(3)] == [0, 0, 0]
