"""Outside-style sweep of pools shared by threads (what the other thread tests leave out).

The thread tests before this one drive plain pools (``test_pool_threads*``, ``test_review_threads*``,
``test_pool_host_tier_threads``) and allocators (``test_allocator_threads*``). These add:

- a hybrid pool (``KVPool(layer_types=...)``: sliding, full and state groups) shared by worker
  threads that open on prefixes, admit, extend, fork, truncate, cache and close their own
  requests while another thread evicts, clears the cache, drains events, reads ``stats()`` and
  runs ``check()``: every request reads back, through its table rows, the K/V (and state)
  written for its own tokens, on the CPU table path and on the device one;
- a ``GroupedAllocator`` used directly by threads (its own mutex, no pool lock around it).

The event stream of a plain pool under threads is ``test_review_threads_events.py``.

Each worker makes a fixed number of calls from a fixed seed; a hang fails at the join.
"""

from __future__ import annotations

import hashlib
import random
import threading

import numpy as np
import pytest
import torch

from kvpool import KVPool, PoolExhaustedError, TooManyRequestsError
from kvpool.errors import RollbackUnavailableError

JOIN_S = 60.0
REFUSED = (PoolExhaustedError, TooManyRequestsError, RollbackUnavailableError)
HYBRID_TYPES = [
    ("sliding_attention", "full_attention", "linear_attention", "sliding_attention"),
    ("sliding_attention",) * 4,
    ("full_attention", "full_attention", "full_attention", "linear_attention"),
]


def value(salt: int, prefix: list[int], layer: int) -> float:
    """A float32-exact K/V value of one position given its request's salt and whole prefix."""
    h = hashlib.blake2b(repr((salt, tuple(prefix))).encode(), digest_size=4).digest()
    return float(int.from_bytes(h, "little") % (1 << 20) + 1 + (1 << 21) * layer)


def run_threads(workers: list, churn) -> None:
    """Run the workers and, until they are done, ``churn(stop)``; re-raise the first error."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - surfaced below
                errors.append(e)
                stop.set()
        return run

    ts = [threading.Thread(target=guard(w), daemon=True) for w in workers]
    c = threading.Thread(target=guard(lambda: churn(stop)), daemon=True)
    for t in [*ts, c]:
        t.start()
    for t in ts:
        t.join(JOIN_S)
    stop.set()
    c.join(JOIN_S)
    assert not any(t.is_alive() for t in [*ts, c]), "a thread hung (deadlock?)"
    if errors:
        raise errors[0]


class Registry:
    """The registered pages replayed from drained events, per (medium, group)."""

    def __init__(self) -> None:
        self.pages: dict[tuple[int, int], set] = {}
        self.problems: list = []

    def apply(self, ev: dict) -> None:
        medium, groups = ev.get("medium"), ev.get("group_idx")
        for i, kind in enumerate(ev["kind"].tolist()):
            key = (int(medium[i]) if medium is not None else 0, int(groups[i]) if groups is not None else 0)
            page = (int(ev["hash_hi"][i]), int(ev["hash_lo"][i]))
            held = self.pages.setdefault(key, set())
            if kind == 0:
                if page in held:
                    self.problems.append(("stored twice", key, page))
                held.add(page)
            elif kind == 1:
                if page not in held:
                    self.problems.append(("removed, never stored", key, page))
                held.discard(page)
            else:
                for s in self.pages.values():
                    s.clear()

    def count(self, medium: int = 0, group: int = 0) -> int:
        return len(self.pages.get((medium, group), ()))


# ----- a hybrid pool shared by threads ------------------------------------------------------


class HybridRun:
    def __init__(self, types: tuple, seed: int, device_tables: bool) -> None:
        rng = random.Random(seed)
        self.types, self.seed = types, seed
        self.w = rng.choice([2, 3, 4, 8])
        p = rng.choice([1, 2, 4])
        both = "full_attention" in types and "sliding_attention" in types
        page_size = {"full_attention": p, "sliding_attention": rng.choice([p, 2 * p])} if both else p
        group_pages, kw = {}, {}
        if "sliding_attention" in types:
            group_pages["sliding_attention"] = rng.randint(20, 40)
        if "linear_attention" in types:
            group_pages["linear_attention"] = rng.randint(10, 20)
            kw["state_shapes"] = {"s": (1,)}
        self.pool = KVPool(4, 1, 1, layer_types=list(types), sliding_window=self.w, dtype=torch.float32,
                           page_size=page_size, num_pages=rng.randint(20, 40), max_requests=10, max_context_len=48,
                           group_pages=group_pages, hash_seed=seed, **kw)
        if device_tables:
            self.pool._tables_np = None  # the table path of a device pool (rows scattered by the pool)
        self.att = [i for i, t in enumerate(types) if t != "linear_attention"]
        self.states = [i for i, t in enumerate(types) if t == "linear_attention"]
        self.bases = [[rng.randint(1, 2) for _ in range(40)] for _ in range(2)]
        self.registry = Registry()

    def write(self, h: int, r: dict, start: int, res) -> None:
        pool = self.pool
        for layer in self.att:
            s = res.slots[pool.group_of_layer[layer]]
            if len(s):
                x = torch.tensor([value(r["salt"], r["toks"][: i + 1], layer) for i in range(start, start + len(s))])
                pool.write(layer, torch.as_tensor(s), x.view(-1, 1, 1), x.view(-1, 1, 1))
        if len(r["toks"]) > start:
            for layer in self.states:
                pool.state(layer, "s")[int(pool.state_slots([h], layer)[0]), 0] = value(r["salt"], r["toks"], layer)

    def verify(self, h: int, r: dict, what: tuple) -> None:
        pool, n = self.pool, len(r["toks"])
        assert pool.length(h) == n, what
        row = int(pool.rows([h])[0])
        for layer in self.att:
            table = pool.req_to_token[layer][row, :n].numpy().astype(np.int64)
            assert table.tolist() == pool.slots(h, layer).tolist(), (self.seed, what, layer)
            first = max(0, n - (self.w - 1)) if self.types[layer] == "sliding_attention" else 0
            if n > first:
                k, v = pool.read(layer, torch.as_tensor(table[first:]))
                want = torch.tensor([value(r["salt"], r["toks"][: i + 1], layer) for i in range(first, n)])
                assert torch.equal(k.view(-1), want) and torch.equal(v.view(-1), want), (self.seed, what, layer)
        for layer in self.states:
            got = float(pool.state(layer, "s")[int(pool.state_slots([h], layer)[0]), 0])
            assert got == (value(r["salt"], r["toks"], layer) if n else 0.0), (self.seed, what, "state", layer)

    def worker(self, wid: int, rounds: int) -> None:
        rng, pool, mine = random.Random(self.seed * 100 + wid), self.pool, {}
        for _ in range(rounds):
            x = rng.random()
            try:
                if x < 0.1 and len(mine) < 3:
                    n = rng.randint(1, 20)
                    toks = [rng.randint(1, 2) for _ in range(n)]
                    hs, res = pool.admit(np.array([n]), tokens=np.array(toks, dtype=np.int64))
                    h = int(hs[0])
                    mine[h] = dict(toks=toks, salt=0, prompt=list(toks))
                    self.write(h, mine[h], 0, res)
                    self.verify(h, mine[h], ("admit", n))
                elif x < 0.3 and len(mine) < 3:
                    n, salt = rng.randint(1, 30), rng.choice([0, 0, 1])
                    prompt = rng.choice(self.bases)[:n] if rng.random() < 0.8 else [rng.randint(1, 2) for _ in range(n)]
                    hs, cached = pool.open_with_prefix(np.array(prompt), np.array([n]), salt=salt)
                    h = int(hs[0])
                    mine[h] = dict(toks=prompt[: int(cached[0])], salt=salt, prompt=prompt)
                    self.verify(h, mine[h], ("open_with_prefix", int(cached[0])))
                elif x < 0.65 and mine:
                    h = rng.choice(list(mine))
                    r, c = mine[h], rng.randint(1, 6)
                    n = len(r["toks"])
                    if n + c > 47:
                        continue
                    toks = [r["prompt"][i] if i < len(r["prompt"]) else rng.randint(1, 2) for i in range(n, n + c)]
                    res = pool.extend(np.array([h]), np.array([c]), tokens=np.array(toks, dtype=np.int64))
                    r["toks"] = r["toks"] + toks
                    self.write(h, r, n, res)
                    self.verify(h, r, ("extend", n, c))
                    if rng.random() < 0.5:
                        pool.cache([h])
                elif x < 0.75 and mine and len(mine) < 3:
                    h = rng.choice(list(mine))
                    for kid in pool.fork(h, 1):
                        mine[int(kid)] = {k: (list(v) if isinstance(v, list) else v) for k, v in mine[h].items()}
                        self.verify(int(kid), mine[int(kid)], ("fork",))
                elif x < 0.85 and mine:
                    h = rng.choice(list(mine))
                    r, n = mine[h], len(mine[h]["toks"])
                    m = rng.randint(max(0, n - 3 * self.w), n)
                    pool.truncate(np.array([h]), np.array([m]))
                    if m < n:
                        r["prompt"], r["toks"] = r["prompt"][:m], r["toks"][:m]
                    self.verify(h, r, ("truncate", n, m))
                elif mine:
                    h = rng.choice(list(mine))
                    pool.close([h], cache=rng.random() < 0.7)
                    del mine[h]
            except REFUSED:
                pass
        pool.close(list(mine), cache=True)

    def churn(self, stop: threading.Event) -> None:
        rng, pool = random.Random(self.seed * 7), self.pool
        while not stop.is_set():
            x = rng.random()
            if x < 0.3:
                pool.evict(rng.randrange(4), rng.randint(1, 4))
            elif x < 0.33:
                pool.clear_cache()
            elif x < 0.6:
                self.registry.apply(pool.take_events())
            elif x < 0.85:
                for g in pool.stats()["groups"]:
                    assert g["free_pages"] + g["used_pages"] == g["capacity_pages"], g
                    assert g["evictable_pages"] <= min(g["free_pages"], g["cached_pages"]), g
            else:
                pool.check()


@pytest.mark.parametrize("device_tables", [False, True], ids=["cpu_tables", "device_tables"])
@pytest.mark.parametrize("types", HYBRID_TYPES, ids=["swa_full_state", "swa_only", "full_state"])
def test_a_hybrid_pool_shared_by_threads_reads_back_every_request(types, device_tables):
    run = HybridRun(types, seed=31 + HYBRID_TYPES.index(types), device_tables=device_tables)
    run_threads([lambda w=w: run.worker(w, 150) for w in range(3)], run.churn)
    pool = run.pool
    pool.check()
    run.registry.apply(pool.take_events())
    assert pool.open_requests == 0
    assert not run.registry.problems, run.registry.problems[:3]
    anchor = pool.allocator.anchor_group
    if anchor is not None:  # the events carry the anchor chain (docs/events-and-metrics.md)
        assert run.registry.count() == pool.allocator.cached_pages(anchor)
    for g in pool.stats()["groups"]:
        assert g["used_pages"] == 0, g


# ----- a GroupedAllocator used directly by threads -------------------------------------------


def test_a_grouped_allocator_shared_by_threads_keeps_its_invariants_and_events():
    run = HybridRun(HYBRID_TYPES[0], seed=77, device_tables=False)
    a = run.pool.allocator  # driven directly: its own mutex, no pool lock around the calls

    def worker(wid: int) -> None:
        rng, mine = random.Random(700 + wid), {}
        for _ in range(400):
            x = rng.random()
            try:
                if x < 0.25 and len(mine) < 3:
                    n = rng.randint(1, 30)
                    prompt = rng.choice(run.bases)[:n]
                    hs, cached = a.open_with_prefix(np.array(prompt), np.array([n]))
                    mine[int(hs[0])] = prompt
                    assert a.length(int(hs[0])) == int(cached[0])
                elif x < 0.6 and mine:
                    h = rng.choice(list(mine))
                    n, c = a.length(h), rng.randint(1, 6)
                    if n + c > 47:
                        continue
                    toks = [mine[h][i] if i < len(mine[h]) else rng.randint(1, 2) for i in range(n, n + c)]
                    a.extend(np.array([h]), np.array([c]), tokens=np.array(toks))
                    assert a.length(h) == n + c and a.known_tokens(h).tolist()[n:] == toks
                    if rng.random() < 0.5:
                        a.cache(np.array([h]))
                elif x < 0.7 and mine and len(mine) < 3:
                    h = rng.choice(list(mine))
                    mine.update({int(k): mine[h] for k in a.fork(h, 1)})
                elif x < 0.8 and mine:
                    h = rng.choice(list(mine))
                    n = a.length(h)
                    m = rng.randint(max(0, n - 3 * run.w), n)
                    a.truncate(np.array([h]), np.array([m]))
                    if m < n:
                        mine[h] = mine[h][:m]
                    assert a.length(h) == m
                elif mine:
                    h = rng.choice(list(mine))
                    a.close(np.array([h]), cache=rng.random() < 0.7)
                    del mine[h]
            except REFUSED:
                pass
        a.close(np.array(list(mine), dtype=np.int64))

    def churn(stop: threading.Event) -> None:
        rng = random.Random(7)
        while not stop.is_set():
            x = rng.random()
            if x < 0.25:
                a.evict(rng.randrange(a.num_groups), rng.randint(1, 4))
            elif x < 0.45:
                for g in range(a.num_groups):  # what the pool's copies would run
                    a.take_copies(g)
            elif x < 0.65:
                run.registry.apply(a.take_events())
            elif x < 0.85:
                for g in a.stats()["groups"]:
                    assert g["free_pages"] + g["used_pages"] == g["capacity_pages"], g
            else:
                a.check()

    run_threads([lambda w=w: worker(w) for w in range(3)], churn)
    a.check()
    for g in range(a.num_groups):  # a queued copy holds its destination until taken
        a.take_copies(g)
    run.registry.apply(a.take_events())
    assert a.open_requests == 0 and not run.registry.problems, run.registry.problems[:3]
    assert all(a.used_pages(g) == 0 for g in range(a.num_groups))
    assert run.registry.count() == a.cached_pages(a.anchor_group)
