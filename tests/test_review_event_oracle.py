"""Outside check: a router's mirror built only from the KV events, against the pool's own truth.

Seeded random traces drive `SlotAllocator`s (page sizes 1, 2 and 16; without a host tier, and
with one under write_back and write_through) through open_with_prefix (batches with a prompt
twice included), admit, extend, cache and close (retention priorities and pins, one per
request), fork, truncate and roll_back_extend into registered pages, evict, unpin, clock
moves, clear_cache, reset, swap_out / swap_in, and a request moved to another pool by
chain_hashes / open_with_chain_hashes. After every step the events go to a mirror keyed by
(hash, medium) and, msgpack-encoded, to a GPU and a CPU `kvpool.router.Router`; then:

- the mirror never sees a page Stored twice on one medium, a Removed it does not hold, a
  Removed page id other than the Stored one, or a Stored entry whose parent, tokens or salt
  differ from the chain the prompt hashes to;
- `stats().cached_pages` / `host_cached_pages` equal the mirror's GPU / CPU pages, and so do
  the routers' `pages()`;
- for every recent prompt, the mirror's GPU prefix is the read-only `match_chain_hashes`;
  an open's cached_len is exactly that prefix without a host tier, and between it and the
  prefix on either tier with one;
- `Router.route` among 2-3 pools names a pool with the longest real device hit, and that hit.

A `GroupedAllocator` (full groups of one page size, or with a sliding or state group) is
held to its documented contract: its anchor group's `cached_pages` equal the mirror's pages,
and its hit never passes what the events predict (equal to it with one full group only).
"""

import numpy as np
import pytest

import kvpool
from kvpool._core import PoolExhaustedError, TooManyRequestsError, encode_kv_events, page_hashes

pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
from kvpool.router import Router  # noqa: E402

SEED, MAX_CTX = 11, 40


class Mirror:
    """A router's view of one pool: (hash, medium) -> (parent, tokens, salt, page)."""

    def __init__(self, ps):
        self.ps, self.m = ps, {}

    def apply(self, ev):
        off = 0
        for i, kind in enumerate(ev["kind"].tolist()):
            if kind == 2:
                self.m.clear()
                continue
            key = ((int(ev["hash_hi"][i]), int(ev["hash_lo"][i])), int(ev["medium"][i]))
            page = int(ev["page"][i])
            if kind == 1:
                assert key in self.m, f"Removed {key} that was never Stored"
                assert self.m.pop(key)[3] == page, "a Removed event names another page than its Stored one"
                continue
            toks = tuple(ev["token_ids"][off:off + self.ps].tolist())
            off += self.ps
            assert int(ev["num_tokens"][i]) == self.ps and key not in self.m, f"{key} Stored twice"
            self.m[key] = ((int(ev["parent_hi"][i]), int(ev["parent_lo"][i])), toks, int(ev["salt"][i]), page)

    def count(self, medium):
        return sum(1 for _, md in self.m if md == medium)

    def prefix(self, toks, salt, media=(0,)):
        """Leading pages of `toks` that the mirror holds on one of `media`, from the root."""
        w = page_hashes(np.asarray(toks, dtype=np.int64), self.ps, SEED, salt)
        n, parent = 0, (0, 0)
        for i in range(len(w) // 2):
            h = (int(w[2 * i]), int(w[2 * i + 1]))
            ent = next((self.m[(h, md)] for md in media if (h, md) in self.m), None)
            if ent is None:
                break
            assert ent[:3] == (parent, tuple(toks[i * self.ps:(i + 1) * self.ps]), salt)
            parent, n = h, n + 1
        return n


def served(a, toks, salt):
    w = page_hashes(np.asarray(toks, dtype=np.int64), a.page_size, SEED, salt)
    n = len(w) // 2
    return a.match_chain_hashes(w, np.asarray(toks[:n * a.page_size], dtype=np.int64), salt)


class Trace:
    def __init__(self, seed, ps, num_pages, host_pages, policy, npools):
        self.rng = rng = np.random.default_rng(seed)
        self.ps, self.host = ps, host_pages
        self.pools = [kvpool.SlotAllocator(num_pages, ps, 8, MAX_CTX, hash_seed=SEED, host_pages=host_pages,
                                           host_policy=policy, manual_clock=True,
                                           max_pinned_pages=int(rng.integers(0, 3))) for _ in range(npools)]
        self.mirrors = [Mirror(ps) for _ in self.pools]
        self.routers = [Router(npools, page_size=ps, hash_seed=SEED, medium=m) for m in ("GPU", "CPU")]
        self.seq, self.reqs, self.probes, self.clock = [0] * npools, [{} for _ in self.pools], [], 0.0

    def tokens(self, n):
        return [int(x) for x in self.rng.integers(1, 4, size=n)]

    def prompt(self):
        rng = self.rng
        if self.probes and rng.random() < 0.6:
            s, t = self.probes[int(rng.integers(len(self.probes)))]
            t = list(t[:int(rng.integers(1, len(t) + 1))]) + self.tokens(int(rng.integers(0, 6)))
            return s, t[:MAX_CTX]
        return int(rng.choice([0, 0, 5, -3, 2**63 - 1])), self.tokens(int(rng.integers(1, 25)))

    def drain(self, k):
        a, mi = self.pools[k], self.mirrors[k]
        ev = a.take_events()
        mi.apply(ev)
        payload = encode_kv_events(ev, 1.0 + self.seq[k])[0]
        for r in self.routers:
            r.feed(k, b"", self.seq[k].to_bytes(8, "big"), payload)
        self.seq[k] += 1
        a.take_offloads(), a.take_loads(), a.take_copies()  # as an engine runs them
        a.check()
        st = a.stats()
        assert (st.cached_pages, st.host_cached_pages) == (mi.count(0), mi.count(1) if self.host else 0)
        assert [r.pages(k) for r in self.routers] == [mi.count(0), mi.count(1)]
        for s, t in self.probes[-40:]:
            assert mi.prefix(t, s) == served(a, t, s), (s, t)

    def check_open(self, k, prompts, cached):
        for (s, t), c, (lo, hi) in zip(prompts, cached, self._bounds(k, prompts)):
            assert lo <= c <= hi and (self.host or c == lo), (s, t, c, lo, hi)

    def _bounds(self, k, prompts):
        mi = self.mirrors[k]
        return [(min(mi.prefix(t, s), (len(t) - 1) // self.ps) * self.ps,
                 min(mi.prefix(t, s, (0, 1)), (len(t) - 1) // self.ps) * self.ps) for s, t in prompts]

    def pick(self, k, swapped=False):
        a, live = self.pools[k], list(self.reqs[k])
        live = [h for h in live if a.is_swapped(h) == swapped]
        return int(self.rng.choice(live)) if live else None

    def step(self):  # noqa: C901 - one branch per call
        rng, ps = self.rng, self.ps
        k = int(rng.integers(len(self.pools)))
        a, R = self.pools[k], self.reqs[k]
        op = rng.choice(OPS, p=WEIGHTS)
        h = self.pick(k)
        if op == "open":
            batch = [self.prompt() for _ in range(int(rng.integers(1, 4)))]
            if rng.random() < 0.3:
                batch.append(batch[0])
            bounds = self._bounds(k, batch)
            hs, cl = a.open_with_prefix(np.array([x for _, t in batch for x in t]), [len(t) for _, t in batch],
                                        salt=[s for s, _ in batch])
            for (s, t), c, (lo, hi) in zip(batch, cl.tolist(), bounds):
                assert lo <= c <= hi and (self.host or c == lo), (s, t, c, lo, hi)
            for (s, t), hh in zip(batch, hs.tolist()):
                R[hh] = (s, t)
                self.probes.append((s, tuple(t) + (1,)))
        elif op == "admit":
            batch = [self.tokens(int(rng.integers(1, 20))) for _ in range(int(rng.integers(1, 3)))]
            hs, _ = a.admit([len(t) for t in batch], tokens=[x for t in batch for x in t])
            R.update({hh: (0, t) for hh, t in zip(hs.tolist(), batch)})
        elif op == "extend" and h is not None:
            s, t = R[h]
            n = min(int(rng.integers(1, 8)), MAX_CTX - a.length(h))
            L = a.length(h)
            if n > 0:
                t = list(t) + self.tokens(max(0, L + n - len(t)))
                R[h] = (s, t)
                a.extend([h], [n], tokens=t[L:L + n])
        elif op == "cache" and h is not None:
            p = rng.choice([-1, -1, 0, 35, 60, 100])
            a.cache([h], priority=None if p < 0 else int(p), retain_s=None if rng.random() < 0.5 or p < 0 else 5.0)
            s, t = R[h]
            self.probes.append((s, tuple(t[:a.length(h)]) + (1,)))
        elif op == "close" and R:
            hs = [int(x) for x in rng.permutation(list(R))[:int(rng.integers(1, 4))]]
            keep = rng.random() < 0.7 and not any(a.is_swapped(x) for x in hs)
            pr = [int(x) for x in rng.choice([0, 35, 60, 100], size=len(hs))] if keep else None
            a.close(hs, cache=bool(keep), priority=pr)
            for x in hs:
                R.pop(x)
        elif op == "fork" and h is not None:
            for c in a.fork(h, int(rng.integers(1, 3))).tolist():
                R[c] = R[h]
        elif op in ("truncate", "roll_back") and h is not None:
            L = a.length(h)
            n = int(rng.integers(0, L + 1))
            if op == "truncate":
                a.truncate([h], [n])
                if n < L:  # (cut inside its prompt, a request forgets the rest of it)
                    R[h] = (R[h][0], R[h][1][:n])
            else:
                a.roll_back_extend([h], [n])
        elif op == "evict":
            a.evict(int(rng.integers(1, 5)))
        elif op == "unpin" and h is not None:
            a.unpin([h])
        elif op == "clock":
            self.clock += 3.0
            a.set_clock(self.clock)
        elif op == "clear":
            a.clear_cache()
        elif op == "reset":
            a.reset()
            R.clear()
        elif op == "swap_out" and self.host and h is not None:
            a.swap_out([h])
        elif op == "swap_in" and self.host and (g := self.pick(k, swapped=True)) is not None:
            a.swap_in([g])
        elif op == "move" and len(self.pools) > 1 and h is not None:
            j = (k + 1 + int(rng.integers(len(self.pools) - 1))) % len(self.pools)
            b = self.pools[j]
            words, toks, salt = a.chain_hashes(h)
            cached = b.match_chain_hashes(words, toks, salt)
            assert cached == self.mirrors[j].prefix(list(toks), salt)
            hb, _ = b.open_with_chain_hashes(words, toks, salt, max_pages=cached, length=a.length(h))
            a.close([h])
            R.pop(h)
            self.reqs[j][int(hb)] = (salt, list(toks))
            self.drain(j)
        elif op == "route" and len(self.pools) > 1:
            for j in range(len(self.pools)):
                self.drain(j)
            s, t = self.prompt()
            r = self.routers[0].route(t, salt=s)
            real = [min(served(b, t, s), (len(t) - 1) // ps) * ps for b in self.pools]
            assert (r.cached_tokens, real[r.pool]) == (max(real), max(real)), (s, t, r, real)
            self.routers[0].finished(r.pool)
        self.drain(k)


OPS = ["open", "admit", "extend", "cache", "close", "fork", "truncate", "roll_back", "evict", "unpin", "clock",
       "clear", "reset", "swap_out", "swap_in", "move", "route"]
WEIGHTS = np.array([20, 3, 24, 8, 14, 5, 5, 3, 3, 1, 1.5, 0.5, 0.5, 4, 4, 4, 4])
WEIGHTS = WEIGHTS / WEIGHTS.sum()


@pytest.mark.parametrize("ps, num_pages, host_pages, policy", [
    (1, 24, 0, "write_back"), (2, 14, 0, "write_back"), (16, 5, 0, "write_back"),
    (1, 24, 12, "write_back"), (2, 10, 8, "write_back"), (2, 10, 8, "write_through"),
    (16, 5, 4, "write_back"), (16, 5, 4, "write_through"),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_event_mirror_is_what_the_pool_holds(seed, ps, num_pages, host_pages, policy):
    trace = Trace(seed, ps, num_pages, host_pages, policy, npools=1 + seed)
    for _ in range(250):
        try:
            trace.step()
        except (PoolExhaustedError, TooManyRequestsError):
            for k in range(len(trace.pools)):
                trace.drain(k)  # a refusal changes nothing: the mirror still agrees


GROUPS = [
    [dict(kind="full", num_pages=12, page_size=2)],
    [dict(kind="full", num_pages=12, page_size=2), dict(kind="full", num_pages=10, page_size=2)],
    [dict(kind="full", num_pages=12, page_size=2), dict(kind="full", num_pages=8, page_size=4)],
    [dict(kind="full", num_pages=14, page_size=4), dict(kind="sliding", num_pages=12, page_size=2, window=5)],
    [dict(kind="full", num_pages=14, page_size=2), dict(kind="state", num_slots=10, checkpoint_every=4)],
    [dict(kind="sliding", num_pages=12, page_size=2, window=3), dict(kind="sliding", num_pages=12, page_size=3,
                                                                    window=7)],
]


@pytest.mark.parametrize("groups", GROUPS, ids=lambda g: "+".join(f"{x['kind']}{x.get('page_size', '')}" for x in g))
def test_a_grouped_pools_anchor_events_bound_its_hits(groups):
    rng = np.random.default_rng(3)
    a = kvpool.GroupedAllocator(groups, 6, 48, hash_seed=SEED, anchor_pages=10)
    aps, step = a.anchor_page_size, a.hit_step
    # One full group: exact. Any other group (even a full one of the same page size, which
    # evicts from its own LRU) may lower the hit below the anchor's, with no event.
    exact = len(groups) == 1 and groups[0]["kind"] == "full"
    mi, reqs, probes = Mirror(aps), {}, []
    for _ in range(400):
        op = rng.choice(["open", "extend", "cache", "close", "truncate", "evict", "clear"],
                        p=[0.3, 0.3, 0.1, 0.2, 0.05, 0.04, 0.01])
        live = list(reqs)
        h = int(rng.choice(live)) if live else None
        try:
            if op == "open":
                if probes and rng.random() < 0.6:
                    s, t = probes[int(rng.integers(len(probes)))]
                    t = list(t[:int(rng.integers(1, len(t) + 1))]) + [int(x) for x in rng.integers(1, 4, 3)]
                else:
                    s, t = int(rng.choice([0, 5])), [int(x) for x in rng.integers(1, 4, int(rng.integers(1, 25)))]
                pred = min(mi.prefix(t, s) * aps, len(t) - 1) // step * step
                hs, cl = a.open_with_prefix(np.array(t), [len(t)], salt=s)
                assert int(cl[0]) <= pred and (not exact or int(cl[0]) == pred), (s, t, int(cl[0]), pred)
                reqs[int(hs[0])] = (s, t)
                probes.append((s, tuple(t) + (1,)))
            elif op == "extend" and h is not None:
                s, t = reqs[h]
                L = a.length(h)
                n = min(int(rng.integers(1, 8)), 48 - L)
                t = list(t) + [int(x) for x in rng.integers(1, 4, max(0, L + n - len(t)))]
                reqs[h] = (s, t)
                a.extend([h], [n], tokens=t[L:L + n])
            elif op == "cache" and h is not None:
                a.cache([h])
            elif op == "close" and h is not None:
                a.close([h], cache=bool(rng.random() < 0.7))
                reqs.pop(h)
            elif op == "truncate" and h is not None:
                L = a.length(h)
                n = int(rng.integers(0, L + 1))
                a.truncate([h], [n])
                if n < L:  # (cut inside its prompt, a request forgets the rest of it)
                    reqs[h] = (reqs[h][0], reqs[h][1][:n])
            elif op == "evict":
                a.evict(int(rng.integers(a.num_groups)), 2)
            elif op == "clear":
                a.clear_cache()
        except (PoolExhaustedError, TooManyRequestsError, kvpool.RollbackUnavailableError):
            pass
        mi.apply(a.take_events())
        for g in range(a.num_groups):
            a.take_copies(g)
        a.check()
        if a.anchor_group is not None:
            assert a.stats()["groups"][a.anchor_group]["cached_pages"] == mi.count(0)
