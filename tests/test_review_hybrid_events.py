"""Where hybrid pools meet prefix caching and KV events (an outside review of the combination).

A hybrid pool (``KVPool(layer_types=...)``) publishes its anchor chain's KV events only
(docs/events-and-metrics.md). hypothesis draws engine-like sequences (prefix opens on
prompts that repeat cached ones, decode, cache, close, truncate and roll_back_extend, fork,
per-group evict, clear_cache, reset, refused calls) over small pools of every group mix, on CPU with
real tensors, on both table paths (the core's, and the scatter CUDA pools use).
K/V at position i is a code of (salt, tokens 0..i, layer), a state row holds the code of
the request's last position, so content served for another prefix reads back wrong.

After every call: ``check()`` passes; the events replay cleanly into a router's view
(``EventMirror``: no page Stored twice, no Removed of a page not stored, every hash the
chain hash of its tokens); every page the events say is held in a real anchor group holds
that chain's K/V in every layer of the group; every live request reads back its codes
(every position of a full layer, the window of a sliding one, the state row); the hit
``open_with_prefix`` returns never passes what the events predict (the documented upper
bound); with no request open, the pages the events hold are the anchor's cached pages.
Every refused call (and every bad input) raises a ``KVPoolError``, records no event and
leaves every counter, length, slot and state row as it was.

The host tier is the plain pool's only: with ``layer_types`` its options are refused
(tests/test_hybrid_pool.py), and the swap / offload / load calls do not exist on a hybrid
pool, which ``test_hybrid_pool_has_no_host_tier_calls`` pins so a tier added to one side
only fails here.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from interactions_common import EventMirror, make_prompt, next_code, root

import kvpool
from kvpool import KVPool, KVPoolError

H, D, MAX_REQ, MAX_CTX = 1, 2, 4, 40
TYPES = [
    ("full_attention", "sliding_attention", "linear_attention"),
    ("sliding_attention", "full_attention"),
    ("sliding_attention", "sliding_attention"),  # a token-only anchor
    ("linear_attention", "full_attention"),
]
SYSTEMS = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 0, 1, 2], [3, 2, 1, 0, 3, 2, 1, 0, 1, 1]]


def codes_of(salt: int, toks: list[int]) -> list[int]:
    out, c = [], root(salt)
    for t in toks:
        c = next_code(c, t)
        out.append(c)
    return out


def kv_rows(codes: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    c = torch.tensor(codes, dtype=torch.int64)
    k = ((c & 0xFFFFF) + layer * (1 << 20)).float()
    v = ((c >> 20) & 0xFFFFF).float()
    return k.view(-1, 1, 1).expand(-1, H, D).contiguous(), v.view(-1, 1, 1).expand(-1, H, D).contiguous()


class Driver:
    def __init__(self, types, w: int, page: dict, sizes: tuple[int, int, int], device_tables: bool = False) -> None:
        gp: dict = {}
        kw: dict = {}
        if "sliding_attention" in types:
            gp["sliding_attention"] = sizes[1]
        if "linear_attention" in types:
            gp["linear_attention"] = sizes[2]
            kw["state_shapes"] = {"s": ((1,), torch.float64)}
        ps = {t: page[t] for t in set(types) if t != "linear_attention"}
        self.pool = KVPool(len(types), H, D, layer_types=list(types), dtype=torch.float32, page_size=ps,
                           sliding_window=w if "sliding_attention" in types else None,
                           num_pages=sizes[0] if "full_attention" in types else None,
                           group_pages=gp, max_requests=MAX_REQ, max_context_len=MAX_CTX, **kw)
        if device_tables:  # the CUDA pools' path on CPU: the pool scatters rows, the core does not write them
            self.pool._tables_np = None
        self.types, self.w = types, w
        self.att = [i for i, t in enumerate(types) if t != "linear_attention"]
        self.lin = [i for i, t in enumerate(types) if t == "linear_attention"]
        a = self.pool.allocator
        self.mirror = EventMirror(a.anchor_page_size, self.pool.hash_seed)
        self.anchor = a.anchor_group  # None: a token-only anchor (its pages hold no K/V)
        self.reqs: dict[int, tuple[int, list[int]]] = {}  # handle -> (salt, tokens)
        self.prompts: dict[int, list[int]] = {}  # the prompt the pool remembers (open_with_prefix)
        self.seen: list[tuple[list[int], int]] = []

    # ---- the model's side ---------------------------------------------------------
    def write(self, h: int, start: int, res) -> None:
        salt, toks = self.reqs[h]
        codes = codes_of(salt, toks)
        for layer in self.att:
            k, v = kv_rows(codes[start:], layer)
            self.pool.write(layer, res.for_layer(layer), k, v)
        if len(toks) > start:
            for layer in self.lin:
                row = int(self.pool.state_slots([h], layer)[0])
                self.pool.state(layer, "s")[row] = float(codes[-1])

    # ---- what a refusal must leave as it was ----------------------------------------
    def snapshot(self):
        p, a = self.pool, self.pool.allocator
        per_group = [(a.free_pages(g), a.used_pages(g), a.cached_pages(g), a.capacity_pages(g))
                     for g in range(a.num_groups)]
        reqs = []
        for h in sorted(self.reqs):
            row = [h, p.length(h)]
            row += [p.slots(h, layer).tolist() for layer in self.att]
            for layer in self.lin:
                r = int(p.state_slots([h], layer)[0])
                row += [r, float(p.state(layer, "s")[r])]
            reqs.append(row)
        kv = [(p.k_buffer(layer).clone(), p.v_buffer(layer).clone()) for layer in self.att]
        return (p.open_requests, p.hit_tokens, p.miss_tokens, per_group, reqs), kv

    def refused(self, call, *args) -> KVPoolError:
        before, kv = self.snapshot()
        with pytest.raises(KVPoolError) as err:
            call(*args)
        assert str(err.value), "an error without a message"
        after, kv2 = self.snapshot()
        assert after == before, f"{call.__name__} refused ({err.value!r}) but changed the pool"
        for (k, v), (k2, v2) in zip(kv, kv2):
            assert torch.equal(k, k2) and torch.equal(v, v2), f"{call.__name__} refused but wrote K/V"
        assert len(self.pool.take_events()["kind"]) == 0, f"{call.__name__} refused but recorded events"
        self.pool.check()
        return err.value

    # ---- the check after every call -------------------------------------------------
    def verify(self) -> None:
        p = self.pool
        p.check()
        self.mirror.apply(p.take_events())
        for med, page, _toks, codes in self.mirror.pages():
            assert med == 0, "a hybrid pool has no host tier, yet an event named the host"
            if self.anchor is None:
                continue
            layers = [i for i in self.att if p.group_of_layer[i] == self.anchor]
            ps = p.page_size_of(layers[0])
            for layer in layers:
                k, v = p.read(layer, np.arange(page * ps, (page + 1) * ps))
                ek, ev = kv_rows(codes, layer)
                assert torch.equal(k, ek) and torch.equal(v, ev), f"events say page {page} holds other K/V"
        for h, (salt, toks) in self.reqs.items():
            n = p.length(h)
            assert n == len(toks)
            codes = codes_of(salt, toks)
            for layer in self.att:
                g = p.group(layer)
                row = p.req_to_token[layer][int(p.rows([h])[0]), :n].numpy()
                assert np.array_equal(row, p.slots(h, layer)), f"request {h}'s table row of layer {layer}"
                lo = 0 if g.kind == "full" else max(0, n - self.w + 1)
                slots = p.slots(h, layer)[lo:n]
                assert (slots >= g.page_size).all(), f"layer {layer} lost positions of its window: {slots}"
                k, v = p.read(layer, slots)
                ek, ev = kv_rows(codes[lo:n], layer)
                assert torch.equal(k, ek) and torch.equal(v, ev), f"request {h} layer {layer} reads other K/V"
            for layer in self.lin:
                row = int(p.state_slots([h], layer)[0])
                want = float(codes[-1]) if n else 0.0
                assert float(p.state(layer, "s")[row]) == want, f"request {h} state of layer {layer}"
        if not self.reqs and self.anchor is not None:
            held = len(self.mirror.on_tier[0])
            assert held == p.allocator.cached_pages(self.anchor), "events and the anchor's cache disagree"

    def predicted(self, prompt: list[int], salt: int) -> int:
        """The prefix a router predicts from the events: leading anchor pages it holds."""
        ps = self.pool.allocator.anchor_page_size
        hashes = kvpool._core.page_hashes(prompt, ps, self.pool.hash_seed, salt).reshape(-1, 2)
        n = 0
        for hi, lo in hashes.tolist():
            if (hi, lo) not in self.mirror.on_tier[0]:
                break
            n += 1
        return n * ps

    # ---- operations ---------------------------------------------------------------
    def open(self, rng: random.Random) -> None:
        prompt, salt = make_prompt(rng, SYSTEMS, self.seen, 2)
        prompt = prompt[: MAX_CTX - 4]
        bound = self.predicted(prompt, salt)
        try:
            (h,), (cached,) = self.pool.open_with_prefix(prompt, [len(prompt)], salt=salt)
        except (kvpool.TooManyRequestsError, kvpool.PoolExhaustedError):
            self.refused(self.pool.open_with_prefix, prompt, [len(prompt)], salt)  # it changed nothing
            return
        h, cached = int(h), int(cached)
        assert cached <= bound, f"hit {cached} passes the events' prediction {bound}"
        assert cached < len(prompt)
        self.reqs[h] = (salt, list(prompt[:cached]))
        self.prompts[h] = list(prompt)
        self.verify()
        if not self.grow(h, prompt[cached:], rng):
            return
        self.seen.append((prompt, salt))

    def admit(self, rng: random.Random) -> None:
        """Two requests opened and prefilled in one call (no prefix lookup); salt 0."""
        prompts = [make_prompt(rng, SYSTEMS, self.seen, 2)[0][: MAX_CTX // 2] for _ in range(2)]
        counts, flat = [len(x) for x in prompts], [t for x in prompts for t in x]
        try:
            hs, res = self.pool.admit(counts, tokens=flat)
        except (kvpool.TooManyRequestsError, kvpool.PoolExhaustedError):
            self.refused(self.pool.admit, counts, flat)
            return
        for h, x in zip(hs.tolist(), prompts):
            self.reqs[int(h)] = (0, list(x))
        salt_rows = [codes_of(0, x) for x in prompts]
        for layer in self.att:
            k = torch.cat([kv_rows(c, layer)[0] for c in salt_rows])
            v = torch.cat([kv_rows(c, layer)[1] for c in salt_rows])
            self.pool.write(layer, res.for_layer(layer), k, v)
        for layer in self.lin:
            rows = self.pool.state_slots(hs, layer)
            for r, c in zip(rows.tolist(), salt_rows):
                self.pool.state(layer, "s")[r] = float(c[-1])

    def grow(self, h: int, new: list[int], rng: random.Random) -> bool:
        salt, toks = self.reqs[h]
        prompt = self.prompts.get(h, [])
        # Positions inside the remembered prompt take its tokens (the pool refuses others).
        new = [prompt[i] if i < len(prompt) else t for i, t in enumerate(new, start=len(toks))]
        if len(toks) + len(new) > MAX_CTX:
            self.refused(self.pool.extend, [h], [len(new)], new)
            return False
        try:
            res = self.pool.extend([h], [len(new)], new)
        except kvpool.PoolExhaustedError:
            self.refused(self.pool.extend, [h], [len(new)], new)  # and again: it changed nothing
            return False
        start = len(toks)
        self.reqs[h] = (salt, toks + list(new))
        self.write(h, start, res)
        return True

    def truncate(self, h: int, n: int, keep_prompt: bool = False) -> None:
        # keep_prompt: roll_back_extend, the path KVPoolCache takes for rows that hit less.
        call = self.pool._truncate_keeping_prompts if keep_prompt else self.pool.truncate
        try:
            call([h], [n])
        except kvpool.RollbackUnavailableError:
            err = self.refused(call, [h], [n])
            assert "group" in str(err), str(err)
            return
        salt, toks = self.reqs[h]
        self.reqs[h] = (salt, toks[:n])
        # As the plain pool: a truncate to the current length changes nothing, the prompt included.
        if not keep_prompt and h in self.prompts and n < len(toks) and n < len(self.prompts[h]):
            self.prompts[h] = self.prompts[h][:n]

    def bad_inputs(self, rng: random.Random) -> None:
        p = self.pool
        live = sorted(self.reqs)
        cases = [
            (p.evict, len(self.types), 1),  # no such layer
            (p.evict, 0, -1),
            (p.open_with_prefix, [1, 2, 3], [4]),  # a length past the tokens
            (p.open_with_prefix, [1] * (MAX_CTX + 2), [MAX_CTX + 1]),
            (p.extend, [10**6], [1]),  # no such handle
            (p.close, [10**6]),
            (p.fork, 10**6),
        ]
        if self.lin:
            cases.append((p.state, self.att[0] if self.att else 0, "s"))
        if live:
            h = rng.choice(live)
            n = p.length(h)
            cases += [
                (p.extend, [h], [MAX_CTX - n + 1]),  # past max_context_len
                (p.extend, [h, h], [1, 1]),  # a duplicate handle
                (p.extend, [h], [-1]),
                (p.truncate, [h], [n + 1]),  # truncate grows nothing
                (p.extend, [h], [2], [1]),  # tokens of the wrong length
                (p.cache, [h], 5),  # a retention priority: the plain pool's only
                (p.close, [h], False, 5),
            ]
        for call, *args in rng.sample(cases, 3):
            err = self.refused(call, *args)
            assert isinstance(err, KVPoolError)

    def step(self, rng: random.Random) -> None:
        op = rng.choices(["open", "decode", "cache", "close", "truncate", "fork", "evict", "clear", "bad", "admit",
                          "reset"], [5, 4, 3, 4, 2, 1, 2, 0.3, 1, 1, 0.2])[0]
        live = sorted(self.reqs)
        if op == "open" or (not live and op in ("decode", "cache", "close", "truncate", "fork")):
            self.open(rng)
        elif op == "decode":
            h = rng.choice(live)
            self.grow(h, [rng.randrange(4) for _ in range(rng.randint(1, 3))], rng)
        elif op == "cache":
            h = rng.choice(live)
            self.pool.cache([h])
            self.seen.append((list(self.reqs[h][1]), self.reqs[h][0]))
        elif op == "close":
            h = rng.choice(live)
            cache = rng.random() < 0.7
            self.pool.close([h], cache=cache)
            if cache:
                self.seen.append((list(self.reqs[h][1]), self.reqs[h][0]))
            del self.reqs[h]
            self.prompts.pop(h, None)
        elif op == "truncate":
            h = rng.choice(live)
            self.truncate(h, rng.randint(0, len(self.reqs[h][1])), rng.random() < 0.4)
        elif op == "fork":
            h = rng.choice(live)
            try:
                kids = self.pool.fork(h, 1)
            except (kvpool.TooManyRequestsError, kvpool.PoolExhaustedError):
                self.refused(self.pool.fork, h, 1)
                return
            for k in kids.tolist():
                self.reqs[int(k)] = (self.reqs[h][0], list(self.reqs[h][1]))
                if h in self.prompts:
                    self.prompts[int(k)] = list(self.prompts[h])
        elif op == "evict":
            self.pool.evict(rng.randrange(len(self.types)), rng.randint(1, 4))
        elif op == "admit":
            self.admit(rng)
        elif op == "reset":
            self.pool.reset()  # every request closed, uncached; the cache stays
            self.reqs.clear()
            self.prompts.clear()
        elif op == "clear":
            self.pool.clear_cache()
        else:
            self.bad_inputs(rng)
        self.verify()


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(types=st.sampled_from(TYPES), w=st.integers(1, 6), full_ps=st.sampled_from([1, 2, 4]),
       sliding_ps=st.sampled_from([1, 2, 3]), sizes=st.tuples(st.integers(6, 30), st.integers(6, 20),
                                                                st.integers(5, 12)),
       device_tables=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_hybrid_prefix_events_content(types, w, full_ps, sliding_ps, sizes, device_tables, seed):
    try:
        d = Driver(types, w, {"full_attention": full_ps, "sliding_attention": sliding_ps}, sizes, device_tables)
    except kvpool.InvalidArgumentError:
        return  # a group too small for one request's need at these sizes: the planner refuses it
    rng = random.Random(seed)
    for _ in range(50):
        d.step(rng)
    for h in sorted(d.reqs):
        d.pool.close([h], cache=True)
    d.reqs.clear()
    d.verify()
    d.pool.clear_cache()
    d.verify()
    assert not d.mirror.on_tier[0], "clear_cache left pages the events still hold"
    a = d.pool.allocator
    for g in range(a.num_groups):
        assert a.used_pages(g) == 0 and a.cached_pages(g) == 0


HOST_CALLS = ["swap_out", "swap_in", "is_swapped", "take_loads", "take_offloads", "offloaded_pages",
              "pending_offloads", "host_pages"]


def test_hybrid_pool_has_no_host_tier_calls():
    """No half-built host tier: the pool and its core lack every swap / offload / load call
    (the options are refused at construction, test_hybrid_pool.py). A tier added to a
    hybrid pool must come with the combination's tests; this fails first."""
    pool = KVPool(2, H, D, layer_types=["full_attention", "sliding_attention"], sliding_window=2,
                  page_size=2, num_pages=8, max_requests=2, max_context_len=16)
    for name in HOST_CALLS:
        assert not hasattr(pool, name) and not hasattr(pool.allocator, name), name
    with pytest.raises(kvpool.InvalidArgumentError, match="host_pages=4 is not supported with layer_types"):
        KVPool(2, H, D, layer_types=["full_attention", "sliding_attention"], sliding_window=2,
               page_size=2, num_pages=8, host_pages=4)


@pytest.mark.parametrize("kw", [dict(host_pages=np.int64(0)), dict(tp_size=np.int64(1), tp_rank=np.int32(0)),
                                dict(host_pages=np.uint8(0))])
def test_numpy_ints_that_mean_no_tier_are_the_default(kw):
    """The plain pool takes numpy ints for these (a config read through numpy), and its
    host_pages=np.int64(0) is no host tier; a hybrid pool refused them as unsupported
    features although they ask for none."""
    pool = KVPool(2, H, D, layer_types=["full_attention", "sliding_attention"], sliding_window=2,
                  page_size=2, num_pages=8, **kw)
    pool.check()


@pytest.mark.parametrize("kw", [dict(host_pages=np.int64(4)), dict(tp_size=np.int64(2)), dict(host_pages=True),
                                dict(host_pages=0.0)])
def test_a_host_tier_or_sharding_asked_for_is_refused_saying_what_to_pass(kw):
    (name, value), = kw.items()
    with pytest.raises(kvpool.InvalidArgumentError) as err:
        KVPool(2, H, D, layer_types=["full_attention", "sliding_attention"], sliding_window=2,
               page_size=2, num_pages=8, **kw)
    msg = str(err.value)
    assert f"{name}={value!r} is not supported with layer_types" in msg, msg
    assert "leave it out" in msg, msg


def test_a_handle_named_twice_is_refused_with_advice_that_fits_the_call():
    """The duplicate-handle refusal told every call to "pass each request once with its
    total count", advice that fits extend only (close, cache, truncate, swap_out take no
    count). Pools of both kinds; nothing changes."""
    hybrid = KVPool(2, H, D, layer_types=["full_attention", "sliding_attention"], sliding_window=2,
                    page_size=2, num_pages=8, max_requests=2, max_context_len=16)
    plain = KVPool(2, H, D, page_size=2, num_pages=8, host_pages=8, max_requests=2, max_context_len=16)
    for pool in (hybrid, plain):
        h, _ = pool.admit([3])
        h2 = [int(h[0]), int(h[0])]
        calls = [("close", lambda: pool.close(h2)), ("cache", lambda: pool.cache(h2)),
                 ("truncate", lambda: pool.truncate(h2, [1, 1])), ("extend", lambda: pool.extend(h2, [1, 1]))]
        if pool is plain:
            calls.append(("swap_out", lambda: pool.swap_out(h2)))
        for name, call in calls:
            with pytest.raises(kvpool.InvalidArgumentError) as err:
                call()
            msg = str(err.value)
            assert "appears more than once" in msg and "name each request once" in msg, (name, msg)
            assert ("total count" in msg) == (name == "extend") or "extend:" in msg, (name, msg)
            assert pool.length(int(h[0])) == 3
            pool.check()
