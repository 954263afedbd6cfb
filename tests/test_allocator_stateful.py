"""Hypothesis state machine: the Rust allocator against a pure-Python model.

The model is independent and naive (a list of slots per request, a free page
stack, LIFO rows); after every step the two must agree on every query, and
check() must pass. Errors must agree in type and leave both unchanged."""

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kvpool
from kvpool import SlotAllocator

MAX_REQ, MAX_CTX = 5, 20


class Model:
    def __init__(self, num_pages, ps):
        self.ps = ps
        self.free = list(range(num_pages - 1, 0, -1))  # top = end: 1 first
        self.free_rows = list(range(MAX_REQ - 1, -1, -1))
        self.gen = [0] * MAX_REQ
        self.reqs = {}  # row -> slots

    def row(self, h):
        r = h & 0xFFFFFFFF
        if h >= 0 and r < MAX_REQ and r in self.reqs and h >> 32 == self.gen[r]:
            return r
        return None

    def pages(self, r):
        return [s // self.ps for t, s in enumerate(self.reqs[r]) if t % self.ps == 0]

    def batch_rows(self, hs):
        rows = []
        for h in hs:
            r = self.row(h)
            if r is None:
                raise kvpool.InvalidHandleError
            if r in rows:
                raise kvpool.InvalidArgumentError
            rows.append(r)
        return rows

    def open(self, n):
        if n > len(self.free_rows):
            raise kvpool.TooManyRequestsError
        out = []
        for _ in range(n):
            r = self.free_rows.pop()
            self.gen[r] += 1
            self.reqs[r] = []
            out.append((self.gen[r] << 32) | r)
        return out

    def extend(self, hs, cs):
        need = 0
        for i in range(len(hs)):
            r = self.batch_rows(hs[: i + 1])[i]
            n = len(self.reqs[r])
            if cs[i] < 0:
                raise kvpool.InvalidArgumentError
            if n + cs[i] > MAX_CTX:
                raise kvpool.ContextTooLongError
            need += -(-(n + cs[i]) // self.ps) - (-(-n // self.ps))
        if need > len(self.free):
            raise kvpool.PoolExhaustedError
        out = []
        for h, c in zip(hs, cs):
            r = self.row(h)
            for _ in range(c):
                t = len(self.reqs[r])
                page = self.free.pop() if t % self.ps == 0 else self.pages(r)[-1]
                self.reqs[r].append(page * self.ps + t % self.ps)
                out.append(self.reqs[r][-1])
        return out

    def truncate(self, hs, ls):
        for i in range(len(hs)):
            r = self.batch_rows(hs[: i + 1])[i]
            if not 0 <= ls[i] <= len(self.reqs[r]):
                raise kvpool.InvalidArgumentError
        for h, n in zip(hs, ls):
            r = self.row(h)
            keep = -(-n // self.ps)
            self.free.extend(reversed(self.pages(r)[keep:]))
            del self.reqs[r][n:]

    def close(self, hs):
        for r in self.batch_rows(hs):
            self.free.extend(reversed(self.pages(r)))
            del self.reqs[r]
            self.free_rows.append(r)


def run_both(real, model):
    """Runs both calls; they must both succeed (returning results) or raise the same type."""
    try:
        expected = model()
    except kvpool.KVPoolError as e:
        try:
            real()
        except kvpool.KVPoolError as got:
            assert type(got) is type(e), f"allocator raised {got!r}, model {type(e).__name__}"
            return None
        raise AssertionError(f"model raised {type(e).__name__}, allocator succeeded")
    return real(), expected


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(1, 48), ps=st.sampled_from([1, 2, 3, 4]))
    def setup(self, num_pages, ps):
        self.a = SlotAllocator(num_pages, ps, MAX_REQ, MAX_CTX)
        self.m = Model(num_pages, ps)
        self.issued = [-3, (7 << 32) | 2]  # never-issued handles ride along

    def pick(self, data, n):
        """Distinct open handles, and now and then one more from every handle
        ever issued (stale, closed, bogus or a duplicate) so errors get tested."""
        open_ = [h for h in self.issued if self.m.row(h) is not None]
        hs = data.draw(st.lists(st.sampled_from(open_), unique=True, min_size=1, max_size=n)) if open_ else []
        if data.draw(st.integers(0, 4)) == 0:
            hs.insert(data.draw(st.integers(0, len(hs))), data.draw(st.sampled_from(self.issued)))
        return hs

    @rule(n=st.integers(1, 3))
    def open(self, n):
        r = run_both(lambda: self.a.open(n), lambda: self.m.open(n))
        if r:
            assert r[0].tolist() == r[1]
            self.issued += r[1]

    @rule(data=st.data(), as_array=st.booleans())
    def extend(self, data, as_array):
        hs = self.pick(data, 4)
        grow = st.integers(1, 6)  # hypothesis favours 0 and [] heavily; make most steps do work
        count = st.one_of(grow, grow, grow, st.integers(0, 6), st.just(-1))
        cs = data.draw(st.lists(count, min_size=len(hs), max_size=len(hs)))
        arg = np.array(hs, dtype=np.int64) if as_array else hs
        r = run_both(lambda: self.a.extend(arg, cs), lambda: self.m.extend(hs, cs))
        if r:
            assert r[0].tolist() == r[1]

    @rule(data=st.data())
    def grow_every_open_request(self, data):
        """Long requests make truncate/close free several pages at once."""
        hs = [h for h in self.issued if self.m.row(h) is not None]
        cs = data.draw(st.lists(st.integers(1, 8), min_size=len(hs), max_size=len(hs)))
        r = run_both(lambda: self.a.extend(np.array(hs, dtype=np.int64), cs), lambda: self.m.extend(hs, cs))
        if r:
            assert r[0].tolist() == r[1]

    @rule(data=st.data())
    def truncate(self, data):
        hs = self.pick(data, 3)
        ls = []
        for h in hs:  # mostly valid new lengths (so pages really get freed), sometimes not
            r = self.m.row(h)
            cur = len(self.m.reqs[r]) if r is not None else 0
            ok = st.integers(0, cur)
            ls.append(data.draw(st.one_of(ok, ok, ok, st.sampled_from([-1, cur + 1]))))
        run_both(lambda: self.a.truncate(hs, ls), lambda: self.m.truncate(hs, ls))

    @rule(data=st.data())
    def close(self, data):
        hs = self.pick(data, 2)
        run_both(lambda: self.a.close(hs), lambda: self.m.close(hs))

    @invariant()
    def agrees_with_model(self):
        if not hasattr(self, "a"):
            return
        self.a.check()
        assert self.a.free_pages == len(self.m.free)
        assert self.a.open_requests == len(self.m.reqs)
        for h in self.issued:
            r = self.m.row(h)
            assert self.a.is_open(h) == (r is not None)
            if r is not None:
                assert self.a.slots(h).tolist() == self.m.reqs[r]
                assert self.a.pages(h).tolist() == self.m.pages(r)


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
