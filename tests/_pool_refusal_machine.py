"""The torch pool's refusal state machine (``PoolRefusalMachine``) and what it compares:
the plain pool's (tests/test_refusals_pool_stateful.py, whose docstring says what the machine
checks) and the hybrid pool's (tests/test_refusals_hybrid_stateful.py, a subclass)."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from pool_refusal_catalogue import ALLOCATOR_LEVEL, FLAKY, FLAKY_LEVEL, ODD, TORCH_LEVEL, PoolCtx, once_index
from test_refusals_stateful import norm

import kvpool
from kvpool import KVPoolError
from kvpool.kernels import gather_kv

MAX_REQ = 6
HASH_SEED = 7
BASES = [[(i * 5 + 1) % 7 for i in range(96)], [(i * 3 + 2) % 7 for i in range(96)]]
GRAD_MODES = {
    "grad": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "inference": torch.inference_mode,
}


@dataclasses.dataclass(frozen=True)
class Config:
    layout: str
    ps: int
    dtype: torch.dtype
    host_pages: int | None = None  # a host tier below the device pages: evictions offload, hits load

    @property
    def max_ctx(self) -> int:
        return 24 if self.ps == 1 else 48

    @property
    def pages(self) -> int:
        return 30 if self.ps == 1 else 6  # 29 or 5 usable pages: eviction happens

    def build(self, seed: int, pages: int | None = None) -> kvpool.KVPool:
        return kvpool.KVPool(2, 2, 4, dtype=self.dtype, page_size=self.ps, num_pages=pages or self.pages,
                             max_requests=MAX_REQ, max_context_len=self.max_ctx, layout=self.layout,
                             hash_seed=HASH_SEED, handle_seed=seed, manual_clock=True, host_pages=self.host_pages)


CONFIGS = [Config(lay, ps, dt) for lay in ("token", "paged") for ps in (1, 16)
           for dt in (torch.float32, torch.float8_e4m3fn)]
CONFIGS += [Config("paged", 16, torch.float32, host_pages=4), Config("token", 1, torch.float8_e4m3fn, host_pages=12)]


def kv_rows(tags: list[int], positions: list[int], layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Rows for (request tag, position) pairs, distinct per pair and layer (also in fp8)."""
    t = torch.tensor(tags, dtype=torch.float32).view(-1, 1, 1)
    p = torch.tensor(positions, dtype=torch.float32).view(-1, 1, 1)
    hd = torch.arange(8, dtype=torch.float32).view(1, 2, 4)
    k = ((t * 37 + p * 11 + layer * 5 + hd * 3) % 53 - 26) / 4
    return k.to(dtype), (-k - 0.25).to(dtype)


def outcome(f):
    try:
        return f(), None
    except KVPoolError as e:
        return None, type(e)


def comparable(x):
    if isinstance(x, torch.Tensor):
        return ("t", str(x.dtype), tuple(x.shape), _Bytes(x))
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return tuple(comparable(v) for v in x)
    if isinstance(x, (list, tuple)):
        return tuple(comparable(v) for v in x)
    return norm(x)


class PoolRefusalMachine(RuleBasedStateMachine):
    BAD = ALLOCATOR_LEVEL + TORCH_LEVEL + FLAKY_LEVEL
    NOT_HERE: set[str] = set()  # catalogue entries that cannot apply to this kind of pool (the sweep's)

    @initialize(cfg=st.sampled_from(CONFIGS))
    def setup(self, cfg):
        self._setup(cfg)

    def slot_limit(self, p):
        """One past the largest slot any layer of ``p`` has."""
        return p.num_slots

    def _setup(self, cfg):
        self.cfg = cfg
        self.ps, self.max_ctx = cfg.ps, cfg.max_ctx
        self.a, self.t = cfg.build(11), cfg.build(11)
        for p in (self.a, self.t):  # host storage starts as torch.empty: the same bytes in both twins
            for name, x in p.named_tensors():
                if name.startswith("host"):
                    x.zero_()
        foreign_pool = cfg.build(12, pages=cfg.pages * 3)
        self.foreign = int(foreign_pool.open(1)[0])
        # A result of the foreign pool that names slots past this pool's num_slots.
        # (a page at a time, so that a hybrid pool's sliding window gives pages back meanwhile)
        self.foreign_loc = None
        while self.foreign_loc is None:
            fh = foreign_pool.open(1)
            while self.foreign_loc is None and foreign_pool.length(fh[0]) < self.max_ctx:
                res = foreign_pool.extend(fh, self.ps)
                loc = res.out_cache_loc if isinstance(res.out_cache_loc, torch.Tensor) else res.out_cache_loc[0]
                if int(loc.max()) >= self.slot_limit(self.a):
                    self.foreign_loc = loc
        self.keep = foreign_pool
        self.live, self.closed, self.prompts, self.tags = [], [], {}, {}
        self.next_tag = 1
        self.own = None  # the subject's last ExtendResult
        self.bad_calls = 0
        self.odd_calls = 0
        self.now = 0.0

    # --- plumbing ------------------------------------------------------------------

    def both(self, f):
        ra, ea = outcome(lambda: f(self.a))
        rt, et = outcome(lambda: f(self.t))
        assert ea is et, f"subject {ea!r} vs twin {et!r}"
        if ea is None:
            assert comparable(ra) == comparable(rt)
        self.ok = ea is None
        return ra, rt

    def lengths(self):
        return {h: int(n) for h, n in zip(self.live, self.t.lengths(self.live))} if self.live else {}

    def pick(self, data, n):
        if not self.live:
            return []
        return data.draw(st.lists(st.sampled_from(self.live), unique=True, min_size=1, max_size=n))

    def opened(self, handles, prompts=None, tag_from=None):
        for i, h in enumerate(np.asarray(handles).tolist()):
            self.live.append(h)
            self.tags[h] = self.next_tag
            self.next_tag += 1
            if prompts is not None:
                self.prompts[h] = list(prompts[i])
            elif tag_from is not None and tag_from in self.prompts:
                self.prompts[h] = list(self.prompts[tag_from])

    def closed_now(self, hs):
        for h in hs:
            self.live.remove(h)
            self.prompts.pop(h, None)
            self.closed.append(h)

    def write_new(self, hs, before, res_a, res_t, how):
        """K/V for every slot an extend (or admit) just handed out, in both pools."""
        tags, pos = [], []
        for h in hs:
            n = int(self.t.length(h))
            tags += [self.tags[h]] * (n - before.get(h, 0))
            pos += list(range(before.get(h, 0), n))
        assert len(tags) == len(res_t.slots)
        for layer in range(2):
            k, v = kv_rows(tags, pos, layer, self.a.compute_dtype)
            for p, res in ((self.a, res_a), (self.t, res_t)):
                p.write(layer, res.out_cache_loc if how == "loc" else res.slots, k, v)
        self.own = res_a

    # --- valid calls ----------------------------------------------------------------

    @rule(n=st.integers(1, 2))
    def open(self, n):
        r, _ = self.both(lambda p: p.open(n))
        if self.ok:
            self.opened(r)

    @rule(counts=st.lists(st.integers(0, 20), min_size=1, max_size=2), how=st.sampled_from(["loc", "slots"]))
    def admit(self, counts, how):
        ra, rt = self.both(lambda p: p.admit(counts))
        if self.ok:
            self.opened(ra[0])
            self.write_new(ra[0].tolist(), {}, ra[1], rt[1], how)

    @rule(data=st.data(), how=st.sampled_from(["loc", "slots"]))
    def extend(self, data, how):
        hs = self.pick(data, 3)
        before = self.lengths()
        counts = [data.draw(st.integers(0, min(2 * self.ps + 2, self.max_ctx - before[h]))) for h in hs]
        ra, rt = self.both(lambda p: p.extend(hs, counts))
        if self.ok:
            self.write_new(hs, before, ra, rt, how)

    @rule(data=st.data(), salt=st.integers(0, 1))
    def open_with_prefix(self, data, salt):
        prompts = [BASES[data.draw(st.integers(0, 1))][: data.draw(st.integers(1, self.max_ctx))]
                   for _ in range(data.draw(st.integers(1, 2)))]
        flat = [t for p in prompts for t in p]
        r, _ = self.both(lambda p: p.open_with_prefix(flat, [len(p) for p in prompts], salt))
        if self.ok:
            self.opened(r[0], prompts=prompts)
            hs = r[0].tolist()
            before = self.lengths()
            toks = [t for h, p in zip(hs, prompts) for t in p[before[h]:]]
            ra, rt = self.both(lambda p: p.extend(hs, [len(q) - before[h] for h, q in zip(hs, prompts)], tokens=toks))
            if self.ok:
                self.write_new(hs, before, ra, rt, "loc")

    @rule(data=st.data())
    def cache(self, data):
        hs = self.pick(data, 2)
        self.both(lambda p: p.cache(hs))

    @rule(data=st.data(), cache=st.booleans())
    def close(self, data, cache):
        hs = self.pick(data, 2)
        self.both(lambda p: p.close(hs, cache=cache))
        if self.ok:
            self.closed_now(hs)

    @rule(data=st.data(), n=st.integers(1, 2))
    def fork(self, data, n):
        hs = self.pick(data, 1)
        if hs:
            r, _ = self.both(lambda p: p.fork(hs[0], n))
            if self.ok:
                self.opened(r, tag_from=hs[0])

    @rule(data=st.data())
    def truncate(self, data):
        hs = self.pick(data, 2)
        lens = self.lengths()
        to = [data.draw(st.integers(0, lens[h])) for h in hs]
        self.both(lambda p: p.truncate(hs, to))
        if self.ok:
            for h, n in zip(hs, to):
                if h in self.prompts:
                    self.prompts[h] = self.prompts[h][:n]

    @rule(n=st.integers(0, 3))
    def evict(self, n):
        self.both(lambda p: p.evict(n))

    @rule()
    def take_events(self):
        self.both(lambda p: p.take_events())

    @rule(data=st.data(), layer=st.integers(0, 1))
    def read(self, data, layer):
        for h in self.pick(data, 2):
            s = self.t.slots(h)
            self.both(lambda p: p.read(layer, s))
            scales = (None, None) if self.a.k_scale is None else (self.a.k_scale[layer:layer + 1],
                                                                   self.a.v_scale[layer:layer + 1])
            self.both(lambda p: gather_kv(p.k_buffer(layer), p.v_buffer(layer), torch.from_numpy(s),
                                          k_scale=None if scales[0] is None else p.k_scale[layer:layer + 1],
                                          v_scale=None if scales[1] is None else p.v_scale[layer:layer + 1]))

    @rule(data=st.data())
    def tables(self, data):
        hs = self.pick(data, 3)
        if hs:
            self.both(lambda p: p.page_table(hs))
            self.both(lambda p: p.req_to_token[torch.from_numpy(p.rows(hs))])

    @rule(dt=st.sampled_from([0.5, 2.0]))
    def set_clock(self, dt):
        self.now += dt
        self.both(lambda p: p.set_clock(self.now))

    # --- rows of an unusual form ----------------------------------------------------

    @rule(data=st.data(), mode=st.sampled_from(sorted(GRAD_MODES)), layer=st.integers(0, 1))
    def odd_rows(self, data, mode, layer):
        hs = self.pick(data, 1)
        if not hs:
            return
        s = self.t.slots(hs[0])
        if not len(s):
            return
        self._odd(data, mode, layer, s)

    def _odd(self, data, mode, layer, s):
        name, odd, plain = data.draw(st.sampled_from(ODD), label="odd")
        k, v = kv_rows([self.next_tag] * len(s), list(range(len(s))), layer, self.a.compute_dtype)
        self.next_tag += 1
        before = self.fingerprint(self.a)
        with GRAD_MODES[mode]():
            ok, err = outcome(lambda: self.a.write(layer, s, odd(k), odd(v)))
        if err is not None:
            assert self.fingerprint(self.a) == before, f"{name} ({mode}): refused, and the pool changed"
            return
        self.t.write(layer, s, plain(k), plain(v))
        self.odd_calls += 1
        assert not any(t.requires_grad or t.is_inference() for _, t in self.a.named_tensors()), name

    # --- an element that answers its __index__ once or twice, then raises ----------------

    @rule(data=st.data(), ok=st.integers(1, 2), mode=st.sampled_from(sorted(GRAD_MODES)))
    def flaky_element(self, data, ok, mode):
        name, call = data.draw(st.sampled_from(FLAKY), label="flaky")
        if self.live:
            self.same_or_refused(name, call, data.draw(st.sampled_from(self.live)), ok, mode)

    def same_or_refused(self, name, call, h, ok, mode):
        """``call`` with an element that answers ``ok`` times then raises, to the subject, and
        with the plain int to the twin: read once it is the twin's call; read again after the
        core committed, it must still be a typed refusal that changed nothing."""
        c = self.ctx(lambda xs: xs[0])
        lens = self.lengths()
        before = self.fingerprint(self.a)
        try:
            with GRAD_MODES[mode]():
                got = call(self.a, c, h, lambda x: once_index(x, ok))
        except KVPoolError:
            after = self.fingerprint(self.a)
            diff = [i for i, (x, y) in enumerate(zip(after, before)) if x != y]
            assert not diff, f"{name} ({ok}, {mode}): refused, and the pool changed: {self.what(diff, after, before)}"
            return False
        except BaseException as e:
            raise AssertionError(f"{name} ({ok}, {mode}): {type(e).__name__} is not a kvpool error: {e}") from e
        ra, ea = got, None
        rt, et = outcome(lambda: call(self.t, c, h, lambda x: x))
        assert et is ea and comparable(ra) == comparable(rt), f"{name} ({ok}, {mode}): not what the twin got"
        for x in [x for x in self.live if not self.t.is_open(x)]:
            self.closed_now([x])
        new = ra[0] if isinstance(ra, tuple) and isinstance(ra[0], np.ndarray) else ra
        if isinstance(new, np.ndarray) and new.dtype == np.int64 and name in ("open", "admit", "fork", "fork(n)"):
            self.opened(new, tag_from=h if name.startswith("fork") else None)
        if isinstance(ra, tuple) and isinstance(ra[1], tuple) and hasattr(ra[1], "_fields"):
            self.write_new(new.tolist(), {}, ra[1], rt[1], "loc")  # admit's prefill
        elif name.startswith("extend"):
            self.write_new([h], lens, ra, rt, "loc")
        self.odd_calls += 1
        self.twins_agree()
        return True

    # --- bad calls ------------------------------------------------------------------

    def ctx(self, pick):
        return PoolCtx(live=list(self.live), lengths=self.lengths(), prompts=self.prompts, stale=list(self.closed),
                       foreign=self.foreign, max_ctx=self.max_ctx, page_size=self.ps, grouped=False, pick=pick,
                       num_layers=2, num_slots=self.slot_limit(self.a), heads=2, dim=4, dtype=self.a.compute_dtype,
                       foreign_loc=self.foreign_loc, own=self.own, room=self.room(), hybrid=False)

    def room(self):
        return self.a.free_slots + self.a.evictable_pages * self.ps

    def bad_call(self, data):
        name, make = data.draw(st.sampled_from(self.BAD), label="bad")
        mode = data.draw(st.sampled_from(sorted(GRAD_MODES)), label="mode")
        self.refuse(name, make, lambda xs: data.draw(st.sampled_from(xs)), mode)

    def refuse(self, name, make, pick, mode="grad"):
        """Makes one bad call on the subject: a typed refusal that changes nothing."""
        thunk = make(self.a, self.ctx(pick))
        if thunk is None:
            return False
        before = self.fingerprint(self.a)
        try:
            with GRAD_MODES[mode]():
                got = thunk()
        except KVPoolError:
            pass
        except BaseException as e:  # PanicException is a BaseException
            raise AssertionError(f"{name} ({mode}): {type(e).__module__}.{type(e).__name__} is not a kvpool "
                                 f"error: {e}") from e
        else:
            raise AssertionError(f"{name} ({mode}): accepted, returned {got!r}")
        self.bad_calls += 1
        after = self.fingerprint(self.a)
        diff = [i for i, (x, y) in enumerate(zip(after, before)) if x != y]
        assert not diff, f"{name} ({mode}): the refusal changed the subject: {self.what(diff, after, before)}"
        twin = self.fingerprint(self.t)
        diff = [i for i, (x, y) in enumerate(zip(after, twin)) if x != y]
        assert not diff, f"{name} ({mode}): the subject no longer matches its twin: {self.what(diff, after, twin)}"
        assert norm(self.a.take_events()) == norm(self.t.take_events()), f"{name} ({mode}): pending events changed"
        return True

    bad_1 = rule(data=st.data())(bad_call)
    bad_2 = rule(data=st.data())(bad_call)
    bad_3 = rule(data=st.data())(bad_call)

    # --- what must agree ------------------------------------------------------------

    FIELDS = ("stats", "requests", "page_table", "pending_copies", "clock", "closed", "tensors", "grad", "row_edits")

    def what(self, diff, x, y):
        out = []
        for i in diff:
            if self.FIELDS[i] == "tensors":
                out += [f"tensor {n} differs" for (n, a), (_, b) in zip(x[i], y[i]) if a != b]
            else:
                out.append(f"{self.FIELDS[i]}: {x[i]!r} vs {y[i]!r}"[:400])
        return "; ".join(out)

    def fingerprint(self, p):
        p.check()
        per = tuple((h, p.length(h), p.slots(h).tolist(), p.pages(h).tolist(), p.known_tokens(h).tolist(),
                     p.rows([h]).tolist()) for h in self.live)
        table = tuple(x.numpy().tobytes() for x in p.page_table(self.live)) if self.live else ()
        tensors = tuple((n, _Bytes(t)) for n, t in p.named_tensors())
        grad = tuple((n, t.requires_grad, t.is_inference()) for n, t in p.named_tensors())
        # what a KVPoolCache learns of calls it did not make (kvpool.row_edits), and whether
        # extend asks the core for copy-on-write work
        edits = (p._row_edits, tuple((n, None if h is None else h.tolist()) for n, h in p._edited_rows), p._sharing)
        return (norm(p.stats()), per, table, p.allocator.pending_copies, p.clock,
                tuple(p.is_open(h) for h in self.closed[-4:]), tensors, grad, edits)

    @invariant()
    def twins_agree(self):
        if hasattr(self, "a"):
            x, y = self.fingerprint(self.a), self.fingerprint(self.t)
            diff = [i for i, (u, w) in enumerate(zip(x, y)) if u != w]
            assert not diff, self.what(diff, x, y)

    def teardown(self):
        if hasattr(self, "a"):
            STATS["bad"] += self.bad_calls
            STATS["odd"] += self.odd_calls


class _Bytes:
    """A tensor's bytes, compared with torch.equal on a uint8 view."""

    def __init__(self, t: torch.Tensor) -> None:
        # (an empty tensor may have a stride of 0, which view() refuses: no bytes to compare)
        self.b = t.detach().contiguous().view(torch.uint8).clone() if t.numel() else torch.empty(0, dtype=torch.uint8)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Bytes) and self.b.shape == other.b.shape and torch.equal(self.b, other.b)

    def __repr__(self) -> str:
        return f"<{self.b.numel()} bytes>"


STATS = {"bad": 0, "odd": 0}

SETTINGS = settings(max_examples=500, stateful_step_count=40, deadline=None,
                    # The same examples every run: a random draw reached as few as 343 bad calls in
                    # 40 runs (the floor is 300), and CI must not fail by chance. Longer random runs
                    # are for hunting, not for the suite.
                    derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
