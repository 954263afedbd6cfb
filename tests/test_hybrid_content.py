"""What a request reads through its table rows of a hybrid pool is the K/V written for its own
tokens, after any sequence of calls.

Random sequences of open, open_with_prefix (salted or not), extend, cache, truncate, the
prompt-keeping roll-back KVPoolCache uses, fork, close and evict run on small pools (so pages
taken back from the cache by a truncate may have been evicted, or reused, in between), with
several windows and page sizes. Every step writes, at each new position of each attention
layer, a value determined by the request's salt and its whole prefix up to that position (and
a state value by the whole sequence), so a stale or null table row, a page another prefix
wrote, or a state that was not restored reads a wrong value. After every call ``check()``
passes, and a refused call leaves every query and every table as it was.

The device pools' table path (rows scattered by the pool, not written by the core) is taken
on CPU by dropping the numpy views of the tables.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
import torch

from kvpool import KVPool, KVPoolError

TYPES = [
    ("sliding_attention", "full_attention", "linear_attention", "sliding_attention"),
    ("sliding_attention", "full_attention", "sliding_attention", "full_attention"),
    ("sliding_attention",) * 4,  # a token-only anchor
    ("sliding_attention", "linear_attention", "sliding_attention", "linear_attention"),
]
MAX_REQ, MAX_CTX = 5, 48


def value(salt: int, prefix: list[int], layer: int) -> float:
    """A float32-exact value of one position's K/V (or a state) given everything before it."""
    h = hashlib.blake2b(repr((salt, tuple(prefix))).encode(), digest_size=4).digest()
    return float(int.from_bytes(h, "little") % (1 << 20) + 1 + (1 << 21) * layer)


class Run:
    def __init__(self, seed: int, device_tables: bool) -> None:
        rng = self.rng = random.Random(seed)
        self.w = rng.choice([2, 3, 4, 5, 8])
        p = rng.choice([1, 2, 3, 4])
        ps = rng.choice([p, 2 * p, p + 1])  # nested page sizes, or a token-only anchor
        self.types = rng.choice(TYPES)
        has_state = "linear_attention" in self.types
        page_size = {"full_attention": p, "sliding_attention": ps} if "full_attention" in self.types else ps
        group_pages = {"sliding_attention": rng.choice([rng.randint(4, 14), rng.randint(14, 40)])}
        kw = {}
        if has_state:
            group_pages["linear_attention"] = rng.randint(4, 12)
            kw["state_shapes"] = {"s": (1,)}
        self.pool = KVPool(4, 1, 1, layer_types=list(self.types), sliding_window=self.w, dtype=torch.float32,
                           page_size=page_size, num_pages=rng.randint(8, 30), max_requests=MAX_REQ,
                           max_context_len=MAX_CTX, group_pages=group_pages, **kw)
        if device_tables:
            self.pool._tables_np = None
        self.att = [i for i, t in enumerate(self.types) if t != "linear_attention"]
        self.states = [i for i, t in enumerate(self.types) if t == "linear_attention"]
        self.reqs: dict[int, dict] = {}  # handle -> its tokens, salt and prompt
        self.bases = [[rng.randint(1, 2) for _ in range(40)] for _ in range(2)]
        self.took_back = 0

    # -- the K/V and states a step writes -------------------------------------------------
    def write(self, h: int, start: int, slots: dict[int, np.ndarray]) -> None:
        r, pool = self.reqs[h], self.pool
        for layer in self.att:
            s = slots[layer]
            x = torch.tensor([value(r["salt"], r["toks"][: i + 1], layer) for i in range(start, start + len(s))])
            pool.write(layer, torch.as_tensor(s), x.view(-1, 1, 1), x.view(-1, 1, 1))
        if len(r["toks"]) > start:
            for layer in self.states:
                slot = int(pool.state_slots([h], layer)[0])
                pool.state(layer, "s")[slot, 0] = value(r["salt"], r["toks"], layer)

    def verify(self, what: tuple) -> None:
        pool = self.pool
        pool.check()
        for h, r in self.reqs.items():
            n = pool.length(h)
            assert n == len(r["toks"]), what
            row = int(pool.rows([h])[0])
            for layer in self.att:
                first = max(0, n - (self.w - 1)) if self.types[layer] == "sliding_attention" else 0
                table = pool.req_to_token[layer][row, first:n].numpy().astype(np.int64)
                assert table.tolist() == pool.slots(h, layer)[first:].tolist(), (what, layer)
                if n > first:
                    k, v = pool.read(layer, torch.as_tensor(table))
                    want = torch.tensor([value(r["salt"], r["toks"][: i + 1], layer) for i in range(first, n)])
                    assert torch.equal(k.view(-1), want) and torch.equal(v.view(-1), want), (what, layer, n)
            for layer in self.states:
                slot = int(pool.state_slots([h], layer)[0])
                want = value(r["salt"], r["toks"], layer) if n else 0.0
                assert float(pool.state(layer, "s")[slot, 0]) == want, (what, layer, n)

    def observed(self) -> list:
        pool = self.pool
        out = [pool.open_requests]
        for g in pool.groups:
            out += [pool.free_pages(g.layers[0]), pool.used_pages(g.layers[0]), pool.cached_pages(g.layers[0])]
        for h in self.reqs:
            out += [pool.length(h), pool.known_tokens(h).tolist()]
            out += [pool.slots(h, layer).tolist() for layer in self.att]
            out += [pool.state_slots([h], layer).tolist() for layer in self.states]
        return out + [t.clone() for t in pool._tables if t is not None]

    # -- the calls ------------------------------------------------------------------------
    def open(self) -> tuple:
        h = int(self.pool.open(1)[0])
        self.reqs[h] = dict(toks=[], salt=0, prompt=[])
        return ("open", h)

    def open_with_prefix(self) -> tuple:
        rng = self.rng
        n = rng.randint(1, 30)
        prompt = rng.choice(self.bases)[:n] if rng.random() < 0.8 else [rng.randint(1, 2) for _ in range(n)]
        salt = rng.choice([0, 0, 1])
        hs, cached = self.pool.open_with_prefix(np.array(prompt), np.array([n]), salt=salt)
        h = int(hs[0])
        self.reqs[h] = dict(toks=prompt[: int(cached[0])], salt=salt, prompt=prompt)
        return ("open_with_prefix", h, n, salt, int(cached[0]))

    def extend(self) -> tuple:
        rng, pool = self.rng, self.pool
        hs = rng.sample(list(self.reqs), rng.randint(1, len(self.reqs)))
        counts, toks = [], []
        for h in hs:
            r, c = self.reqs[h], rng.randint(0, 6)
            n = len(r["toks"])
            toks += [r["prompt"][i] if i < len(r["prompt"]) else rng.randint(1, 2) for i in range(n, n + c)]
            counts.append(c)
        res = pool.extend(np.array(hs), np.array(counts), tokens=np.array(toks, dtype=np.int64))
        k = 0
        for h, c in zip(hs, counts):
            start = len(self.reqs[h]["toks"])
            self.reqs[h]["toks"] = self.reqs[h]["toks"] + toks[k: k + c]
            self.write(h, start, {layer: res.slots[pool.group_of_layer[layer]][k: k + c] for layer in self.att})
            k += c
        if rng.random() < 0.6:  # the step ran: publish it
            pool.cache(np.array(hs))
        return ("extend", hs, counts)

    def truncate(self, keep_prompts: bool) -> tuple:
        rng, pool = self.rng, self.pool
        hs = rng.sample(list(self.reqs), rng.randint(1, len(self.reqs)))
        lens = []
        for h in hs:
            n = len(self.reqs[h]["toks"])
            lens.append(rng.randint(0, n) if rng.random() < 0.3 else rng.randint(max(0, n - 3 * self.w), n))
        sliding = self.types.index("sliding_attention")
        before = {h: pool.pages(h, sliding).tolist() for h in hs}
        if keep_prompts:
            pool._truncate_keeping_prompts(np.array(hs), np.array(lens))
        else:
            pool.truncate(np.array(hs), np.array(lens))
        for h, n in zip(hs, lens):
            r = self.reqs[h]
            if not keep_prompts and n < len(r["toks"]):
                r["prompt"] = r["prompt"][:n]
            r["toks"] = r["toks"][:n]
            after = pool.pages(h, sliding).tolist()
            self.took_back += any(p and not q for p, q in zip(after, before[h]))
        return ("roll_back" if keep_prompts else "truncate", hs, lens)

    def fork(self) -> tuple:
        p = self.rng.choice(list(self.reqs))
        for kid in self.pool.fork(p, 1):
            self.reqs[int(kid)] = {key: (list(v) if isinstance(v, list) else v) for key, v in self.reqs[p].items()}
        return ("fork", p)

    def close(self) -> tuple:
        h = self.rng.choice(list(self.reqs))
        self.pool.close([h], cache=self.rng.random() < 0.7)
        del self.reqs[h]
        return ("close", h)

    def evict(self) -> tuple:
        layer = self.rng.randrange(4)
        return ("evict", layer, self.pool.evict(layer, self.rng.randint(1, 4)))

    def step(self) -> tuple | None:
        rng, has = self.rng, bool(self.reqs)
        room = len(self.reqs) < MAX_REQ
        calls = {"open": (room, self.open), "open_with_prefix": (room, self.open_with_prefix),
                 "extend": (has, self.extend), "cache": (has, lambda: self.pool.cache(list(self.reqs))),
                 "truncate": (has, lambda: self.truncate(False)), "roll_back": (has, lambda: self.truncate(True)),
                 "fork": (has and room, self.fork), "close": (has, self.close), "evict": (True, self.evict)}
        name = rng.choice(["open", "open_with_prefix", "open_with_prefix", "extend", "extend", "extend", "cache",
                           "truncate", "truncate", "roll_back", "roll_back", "fork", "close", "evict"])
        ok, call = calls[name]
        if not ok:
            return None
        before = self.observed()
        try:
            return call() or (name,)
        except KVPoolError as e:
            after = self.observed()
            same = len(after) == len(before) and all(
                torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(after, before))
            assert same, f"a refused {name} ({e!r}) changed the pool"
            return ("refused", name)


@pytest.mark.parametrize("device_tables", [False, True], ids=["core-tables", "scattered-tables"])
@pytest.mark.parametrize("seed", range(12))
def test_every_request_reads_the_kv_of_its_own_tokens(seed, device_tables):
    run = Run(seed, device_tables)
    for _ in range(250):
        what = run.step()
        if what is not None:
            run.verify(what)


def test_the_runs_take_window_pages_back_from_the_cache():
    """The sequences above do reach the take-back (a truncate behind a released window)."""
    took = 0
    for seed in range(12):
        run = Run(seed, False)
        for _ in range(250):
            run.step()
        took += run.took_back
    assert took >= 5, took
