"""Data integrity of hybrid pools: what a request reads back is exactly what it wrote.

A CPU reference model keeps, per live request, the K/V value written at every position of
every attention layer and the value of each linear-attention layer's state. Unlike
tests/test_hybrid_content.py (values determined by the prefix), every write here is a fresh
value, so a copy-on-write that wrote a shared page in place, a fork that shares a state row, or
a page handed to two requests shows even when both wrote the same tokens. A prefix hit, a window
page taken back from the cache and a restored state checkpoint may serve another request's
computation of the same (salt, prefix): the reference accepts any value ever written for exactly
that prefix and adopts it. Positions extended without token ids get ids no prompt has, so
nothing computed after them may serve another request. Pools have several K/V heads and head
dims, both layouts, page sizes that nest or not, both table paths (the core's, and the scatter
CUDA pools use, taken on CPU by dropping the numpy views), and are small, so eviction, LRU
reuse and take-back happen.

After every call: each held position reads its reference through the request's table row (the
whole row equals ``slots``), a sliding layer holds at least its window, the FlashInfer page
table lists the held pages, state rows are distinct and hold their reference, ``check()``
passes, and each group's free + used pages is its capacity, used being the pages live requests
hold. A refused call changes nothing.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool import KVPool, KVPoolError

TYPES = [
    ("sliding_attention", "full_attention", "linear_attention", "sliding_attention"),
    ("full_attention", "sliding_attention"),
    ("sliding_attention", "sliding_attention"),  # a token-only anchor
    ("linear_attention", "full_attention"),
    ("sliding_attention", "linear_attention"),
]
H, D, MAX_REQ, MAX_CTX = 2, 3, 4, 48
BASES = [[1, 2, 1, 1, 2, 2, 1, 2, 1, 1, 2, 1, 1, 1, 2, 2, 1, 2, 2, 1] * 2,
         [1, 2, 1, 1, 2, 1, 2, 1, 2, 2, 1, 1, 2, 2, 1, 1, 1, 2, 1, 1] * 2]
PATTERN = torch.arange(H * D, dtype=torch.float32).view(H, D) / 8  # per head and dim, exact in fp32


class Model:
    """The pool and the reference; ``step`` calls return only after checking the pool."""

    def __init__(self, types, w, p, mults, num_pages, sliding_pages, state_slots, layout, device_tables):
        self.types, self.w = types, w
        has_full, has_state = "full_attention" in types, "linear_attention" in types
        page_size = p * mults[1] if not has_full else p * mults[0]
        if has_full and "sliding_attention" in types:  # nested, or not: a token-only anchor
            page_size = {"full_attention": p * mults[0], "sliding_attention": p * mults[1]}
        gp = {}
        if "sliding_attention" in types:
            gp["sliding_attention"] = sliding_pages
        kw = {}
        if has_state:
            gp["linear_attention"] = state_slots
            kw["state_shapes"] = {"conv": (2,), "rec": ((2, 2), torch.float64)}
        self.pool = KVPool(len(types), H, D, layer_types=list(types), sliding_window=w if "sliding_attention" in types
                           else None, dtype=torch.float32, page_size=page_size,
                           num_pages=num_pages if has_full or "sliding_attention" not in gp else None,
                           group_pages=gp, max_requests=MAX_REQ, max_context_len=MAX_CTX, layout=layout, **kw)
        if device_tables:  # the CUDA pools' path on CPU: the pool scatters rows, the core does not write them
            self.pool._tables_np = None
        self.att = [i for i, t in enumerate(types) if t != "linear_attention"]
        self.lin = [i for i, t in enumerate(types) if t == "linear_attention"]
        self.reqs: dict[int, dict] = {}
        self.written: dict[tuple, set] = {}  # (salt, prefix, layer) -> every value written there
        self.counter = 1.0
        self.published: list[tuple[list, int]] = []  # (tokens, salt) a request cached: prompts that hit

    # ---- values ---------------------------------------------------------------------
    def fresh(self) -> float:
        self.counter += 1.0
        return self.counter

    def note(self, r: dict, n: int, layer: int, val: float) -> None:
        self.written.setdefault((r["salt"], tuple(r["toks"][:n]), layer), set()).add(val)

    def write_step(self, h: int, start: int, slots: dict[int, np.ndarray]) -> None:
        """What the model's step writes: K/V at the new positions, then each state."""
        r, pool = self.reqs[h], self.pool
        n = len(r["toks"])
        for layer in self.att:
            vals = [self.fresh() for _ in range(start, n)]
            x = torch.tensor(vals).view(-1, 1, 1) + PATTERN
            pool.write(layer, torch.as_tensor(slots[layer]), x, -x)
            for i, val in zip(range(start, n), vals):
                r["kv"][layer][i] = val
                self.note(r, i + 1, layer, val)
        if n > start:
            for layer in self.lin:
                val = self.fresh()
                row = int(pool.state_slots([h], layer)[0])
                pool.state(layer, "conv")[row] = val
                pool.state(layer, "rec")[row] = -val
                r["state"][layer] = val
                self.note(r, n, ("state", layer), val)

    def new_req(self, h: int, toks: list, salt: int, prompt: list) -> None:
        self.reqs[h] = dict(toks=list(toks), salt=salt, prompt=list(prompt),
                            kv={layer: [None] * MAX_CTX for layer in self.att},
                            state={layer: None if toks else 0.0 for layer in self.lin})

    # ---- the check after every call ------------------------------------------------
    def read_state(self, h: int, layer: int) -> float:
        row = int(self.pool.state_slots([h], layer)[0])
        c, rec = self.pool.state(layer, "conv")[row], self.pool.state(layer, "rec")[row]
        val = float(c[0])
        assert torch.equal(c, torch.full_like(c, val)) and torch.equal(rec, torch.full_like(rec, -val)), (c, rec)
        return val

    def verify(self) -> None:
        pool = self.pool
        pool.check()
        for h, r in self.reqs.items():
            n = pool.length(h)
            assert n == len(r["toks"]), (h, n, r["toks"])
            row = int(pool.rows([h])[0])
            for layer in self.att:
                g = pool.group(layer)
                slots, pages = pool.slots(h, layer), pool.pages(h, layer)
                table = pool.req_to_token[layer][row, :n].numpy().astype(np.int64)
                assert table.tolist() == slots.tolist(), (h, layer)
                held = [i for i in range(n) if pages[i // g.page_size] != 0]
                need = range(max(0, n - self.w + 1) if g.kind == "sliding" else 0, n)
                assert set(need) <= set(held), ("window or context not held", h, layer, n, pages.tolist())
                nz = np.flatnonzero(pages)
                assert nz.size == 0 or nz.tolist() == list(range(nz[0], len(pages))), pages.tolist()
                pt = pool.page_table([h], layer)
                assert pt.kv_indices.tolist() == pages[nz].tolist(), (pt, pages)
                if n:
                    assert int(pt.kv_last_page_len[0]) == (n - 1) % g.page_size + 1
                k, v = pool.read(layer, torch.as_tensor(table))
                for i in range(n):
                    if i not in held:
                        r["kv"][layer][i] = None  # released by the window: its content is gone
                        continue
                    got = float(k[i, 0, 0])
                    assert torch.equal(k[i], got + PATTERN) and torch.equal(v[i], -(got + PATTERN)), (h, layer, i)
                    want = r["kv"][layer][i]
                    if want is None:  # served from the cache: written for exactly this prefix
                        ok = got in self.written.get((r["salt"], tuple(r["toks"][: i + 1]), layer), ())
                        assert ok, ("K/V served for another prefix", h, layer, i, got)
                        r["kv"][layer][i] = got
                    else:
                        assert got == want, ("K/V changed", h, layer, i, got, want, r["toks"])
            for layer in self.lin:
                got, want = self.read_state(h, layer), r["state"][layer]
                if want is None:
                    ok = got in self.written.get((r["salt"], tuple(r["toks"]), ("state", layer)), ())
                    assert ok, ("state served for another prefix", h, layer, got)
                    r["state"][layer] = got
                else:
                    assert got == want, ("state changed", h, layer, got, want)
        for g in pool.groups:
            layer = g.layers[0]
            assert pool.free_pages(layer) + pool.used_pages(layer) == pool.capacity_pages(layer), g
            if g.kind == "state":
                rows = [int(pool.state_slots([h], layer)[0]) for h in self.reqs]
                assert len(set(rows)) == len(rows) and 0 not in rows, ("state rows shared", rows)
                assert pool.used_pages(layer) == len(rows)
            else:
                held = set()
                for h in self.reqs:
                    held |= set(pool.pages(h, layer).tolist())
                held.discard(0)
                assert pool.used_pages(layer) == len(held), (g, sorted(held))

    def snapshot(self) -> list:
        pool = self.pool
        out: list = [pool.open_requests]
        for g in pool.groups:
            out += [pool.free_pages(g.layers[0]), pool.used_pages(g.layers[0]), pool.cached_pages(g.layers[0])]
        for h in self.reqs:
            out += [pool.length(h)] + [pool.slots(h, la).tolist() for la in self.att]
            out += [pool.state_slots([h], la).tolist() for la in self.lin]
        return out

    def guarded(self, call) -> bool:
        """Run a pool call; a refusal must leave every query as it was. True if it ran."""
        before = self.snapshot()
        try:
            call()
            return True
        except KVPoolError:
            assert self.snapshot() == before, "a refused call changed the pool"
            return False

    # ---- the engine's calls ---------------------------------------------------------
    def extend(self, hs: list, counts: list, publish: bool, rng, anon: bool = False) -> None:
        """``anon``: no token ids given; past its prompt a position's id is unknown (a marker no
        prompt has, so nothing after it may be served to another request)."""
        toks = []
        for h, c in zip(hs, counts):
            r = self.reqs[h]
            n = len(r["toks"])
            toks.append([r["prompt"][i] if i < len(r["prompt"]) else -self.fresh() if anon else rng.choice([1, 2])
                         for i in range(n, n + c)])
        out = []
        flat = None if anon else np.array([t for ts in toks for t in ts], dtype=np.int64)
        if not self.guarded(lambda: out.append(self.pool.extend(np.array(hs), np.array(counts), tokens=flat))):
            return
        res, k = out[0], 0
        for h, c, ts in zip(hs, counts, toks):
            start = len(self.reqs[h]["toks"])
            self.reqs[h]["toks"] += ts
            self.write_step(h, start, {la: res.for_layer(la).numpy()[k: k + c] for la in self.att})
            k += c
        if publish:
            self.pool.cache(np.array(hs))
            for h in hs:
                toks = self.reqs[h]["toks"]
                known = next((i for i, t in enumerate(toks) if t < 0), len(toks))
                self.published = (self.published + [(toks[:known], self.reqs[h]["salt"])])[-8:]

    def admit(self, prompts: list) -> None:
        out = []
        toks = np.array([t for p in prompts for t in p], dtype=np.int64)
        if not self.guarded(lambda: out.append(self.pool.admit(np.array([len(p) for p in prompts]), tokens=toks))):
            return
        hs, res = out[0]
        k = 0
        for h, p in zip(hs, prompts):
            self.new_req(int(h), p, 0, p)
            self.write_step(int(h), 0, {la: res.for_layer(la).numpy()[k: k + len(p)] for la in self.att})
            k += len(p)

    def open_with_prefix(self, prompts: list, salts: list) -> None:
        out = []
        toks = np.array([t for p in prompts for t in p], dtype=np.int64)
        lens = np.array([len(p) for p in prompts])
        if not self.guarded(lambda: out.append(self.pool.open_with_prefix(toks, lens, salt=np.array(salts)))):
            return
        for h, c, p, s in zip(*out[0], prompts, salts):
            self.new_req(int(h), p[: int(c)], s, p)

    def truncate(self, h: int, n: int) -> None:
        r = self.reqs[h]
        if not self.guarded(lambda: self.pool.truncate([h], [n])):
            return
        if n < len(r["toks"]):
            r["toks"], r["prompt"] = r["toks"][:n], r["prompt"][:n]
            for layer in self.att:
                r["kv"][layer][n:] = [None] * (MAX_CTX - n)
            for layer in self.lin:
                r["state"][layer] = 0.0 if n == 0 else None  # restored from a checkpoint at n

    def fork(self, h: int, n: int) -> None:
        out = []
        if self.guarded(lambda: out.append(self.pool.fork(h, n))):
            r = self.reqs[h]
            for kid in out[0]:
                self.reqs[int(kid)] = dict(toks=list(r["toks"]), salt=r["salt"], prompt=list(r["prompt"]),
                                           kv={la: list(v) for la, v in r["kv"].items()}, state=dict(r["state"]))


configs = st.tuples(st.sampled_from(TYPES), st.integers(2, 6), st.integers(1, 2),
                    st.sampled_from([(1, 1), (1, 2), (1, 3), (2, 1), (2, 3)]),
                    st.integers(12, 40), st.integers(6, 24), st.integers(3, 8), st.sampled_from(["token", "paged"]), st.booleans())


class IntegrityMachine(RuleBasedStateMachine):
    @initialize(cfg=configs, seed=st.integers(0, 2**16))
    def setup(self, cfg, seed):
        import random
        self.m = Model(*cfg)
        self.rng = random.Random(seed)

    def pick(self, i: int) -> int:
        hs = sorted(self.m.reqs)
        return hs[i % len(hs)]

    @rule(n=st.integers(1, 2))
    def open(self, n):
        out = []
        if len(self.m.reqs) + n <= MAX_REQ and self.m.guarded(lambda: out.append(self.m.pool.open(n))):
            for h in out[0]:
                self.m.new_req(int(h), [], 0, [])

    @rule(which=st.lists(st.tuples(st.integers(0, 1), st.integers(1, 28), st.sampled_from([0, 0, 0, 1])), min_size=1, max_size=2),
          noise=st.booleans())
    def open_with_prefix(self, which, noise):
        if len(self.m.reqs) + len(which) > MAX_REQ:
            return
        prompts = [list(BASES[b][:n]) for b, n, _ in which]
        if noise:
            prompts[0][-1] = 3 - prompts[0][-1]
        self.m.open_with_prefix(prompts, [s for _, _, s in which])

    @precondition(lambda self: self.m.published)
    @rule(i=st.integers(0, 7), more=st.lists(st.sampled_from([1, 2]), max_size=3))
    def reopen(self, i, more):
        """A prompt that starts with tokens a request published: a hit, unless evicted."""
        toks, salt = self.m.published[-1 - i % len(self.m.published)]
        if len(self.m.reqs) < MAX_REQ and toks + more:
            self.m.open_with_prefix([toks + more], [salt])

    @rule(which=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 12)), min_size=1, max_size=2))
    def admit(self, which):
        if len(self.m.reqs) + len(which) <= MAX_REQ:
            self.m.admit([BASES[b][:n] for b, n in which])

    @precondition(lambda self: self.m.reqs)
    @rule(picks=st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True),
          counts=st.lists(st.integers(0, 6), min_size=3, max_size=3), publish=st.booleans(),
          anon=st.sampled_from([False, False, True]))
    def extend(self, picks, counts, publish, anon):
        hs = list(dict.fromkeys(self.pick(i) for i in picks))
        self.m.extend(hs, counts[: len(hs)], publish, self.rng, anon)

    @precondition(lambda self: self.m.reqs)
    @rule(steps=st.integers(1, 8), publish=st.booleans())
    def decode(self, steps, publish):
        for _ in range(steps):
            hs = sorted(self.m.reqs)
            self.m.extend(hs, [1] * len(hs), publish, self.rng)

    @precondition(lambda self: self.m.reqs)
    @rule(i=st.integers(0, 7), back=st.integers(0, 12), aligned=st.booleans())
    def truncate(self, i, back, aligned):
        h, step = self.pick(i), self.m.pool.allocator.hit_step
        n = max(0, len(self.m.reqs[h]["toks"]) - back)
        self.m.truncate(h, n // step * step if aligned else n)  # aligned: where state checkpoints are

    @precondition(lambda self: self.m.reqs)
    @rule(i=st.integers(0, 7), then_close=st.booleans(), chunked=st.booleans())
    def prefill(self, i, then_close, chunked):
        """An engine's prompt step (chunked: first up to a hit-step boundary, where a state
        checkpoint can be taken), published; maybe the request ends."""
        h, step = self.pick(i), self.m.pool.allocator.hit_step
        r = self.m.reqs[h]
        if chunked and len(r["prompt"]) // step * step > len(r["toks"]):
            self.m.extend([h], [len(r["prompt"]) // step * step - len(r["toks"])], True, self.rng)
        self.m.extend([h], [max(0, len(r["prompt"]) - len(r["toks"]))], True, self.rng)
        if then_close:
            self.m.pool.close([h], cache=True)
            del self.m.reqs[h]

    @precondition(lambda self: self.m.reqs)
    @rule(i=st.integers(0, 7), n=st.integers(1, 2))
    def fork(self, i, n):
        if len(self.m.reqs) + n <= MAX_REQ:
            self.m.fork(self.pick(i), n)

    @precondition(lambda self: self.m.reqs)
    @rule(i=st.integers(0, 7))
    def cache(self, i):
        self.m.pool.cache([self.pick(i)])

    @precondition(lambda self: self.m.reqs)
    @rule(i=st.integers(0, 7), cache=st.booleans())
    def close(self, i, cache):
        h = self.pick(i)
        self.m.pool.close([h], cache=cache)
        del self.m.reqs[h]

    @rule(layer=st.integers(0, 3), n=st.integers(1, 4))
    def evict(self, layer, n):
        self.m.pool.evict(layer % len(self.m.types), n)

    @rule(reset=st.booleans())
    def clear(self, reset):
        if reset:
            self.m.pool.reset()
            self.m.reqs.clear()
        else:
            self.m.pool.clear_cache()

    @invariant()
    def reads_back_what_was_written(self):
        if hasattr(self, "m"):
            self.m.verify()


IntegrityMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck))
test_hybrid_integrity = IntegrityMachine.TestCase


def test_an_extend_by_zero_leaves_held_window_rows_alone_on_the_device_path():
    """The core releases window pages only for requests that grow; the pool's own table
    scatter (CUDA pools) nulled a count-0 request's rows too, whose pages it still held."""
    for device_tables in (False, True):
        pool = KVPool(2, 1, 1, layer_types=["full_attention", "sliding_attention"], sliding_window=2,
                      dtype=torch.float32, page_size=1, num_pages=20, max_requests=2, max_context_len=16)
        if device_tables:
            pool._tables_np = None
        a, b = (int(h) for h in pool.open(2))
        pool.extend([a, b], [4, 4])
        pool.extend([a, b], [0, 1])  # a grows nothing: the core releases nothing of a's
        for h in (a, b):
            row = int(pool.rows([h])[0])
            assert pool.req_to_token[1][row, : pool.length(h)].tolist() == pool.slots(h, 1).tolist(), device_tables


def test_a_prefix_hit_reads_exactly_what_its_one_writer_wrote():
    """Full, sliding (decoded far past its window) and state groups: a later request on the
    same prompt hits at the checkpoint and reads the writer's own K/V and state there."""
    import random
    m = Model(TYPES[0], 4, 2, (1, 1), 64, 64, 32, "token", False)
    rng = random.Random(0)
    prompt = BASES[0][:20]
    m.open_with_prefix([prompt], [0])
    (a,) = m.reqs
    m.extend([a], [16], True, rng)  # a chunk ending where a state checkpoint is taken
    at16 = {la: list(m.reqs[a]["kv"][la][:16]) for la in m.att}
    state16 = dict(m.reqs[a]["state"])
    m.extend([a], [4], True, rng)
    for _ in range(10):
        m.extend([a], [1], True, rng)
    m.verify()
    m.pool.close([a], cache=True)
    del m.reqs[a]
    m.open_with_prefix([prompt], [0])
    (b,) = m.reqs
    assert len(m.reqs[b]["toks"]) == 16  # the longest length with a checkpoint, below 20
    m.verify()  # adopts the hit's values after checking their prefix
    for la in m.att:
        first = 16 - m.w + 1 if m.types[la] == "sliding_attention" else 0
        assert m.reqs[b]["kv"][la][first:16] == at16[la][first:16], la
    assert m.reqs[b]["state"] == state16
