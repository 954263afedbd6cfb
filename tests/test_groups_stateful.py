"""Hypothesis state machine: GroupedAllocator (full, sliding and state groups,
each with its own page size, with or without a token-only anchor) against the
pure-Python model in tests/groups_model.py. After every step the two must
agree on every query (each group's slots, state slots, counters and queued
copies, hit counts) and check() must pass; errors must agree in type, and a
group's refusal in the group it names, leaving both unchanged."""

import re

import pytest
from allocator_model import MAX_CTX, MAX_REQ
from groups_model import GroupsModel
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kvpool
from kvpool import GroupedAllocator

BASES = [[1, 2, 1, 0, 2, 2, 1, 0, 0, 1, 2, 0, 1, 1, 2, 0, 1, 2, 2, 1, 0],
         [1, 2, 1, 0, 0, 0, 2, 1, 2, 2, 0, 1, 0, 2, 1, 1, 0, 0, 2, 1, 1]]

group = st.one_of(
    st.builds(lambda n, ps: {"kind": "full", "num_pages": n, "page_size": ps}, st.integers(2, 14), st.integers(1, 3)),
    st.builds(lambda n, ps, w: {"kind": "sliding", "num_pages": n, "page_size": ps, "window": w},
              st.integers(2, 14), st.integers(1, 3), st.integers(1, 6)),
    st.builds(lambda n, e: {"kind": "state", "num_slots": n, "checkpoint_every": e},
              st.integers(2, 9), st.sampled_from([0, 0, 1, 2])),
)
hybrid = st.builds(
    lambda f, ps, s, w, st_: [{"kind": "full", "num_pages": f, "page_size": ps},
                              {"kind": "sliding", "num_pages": s, "page_size": ps, "window": w},
                              {"kind": "state", "num_slots": st_, "checkpoint_every": 0}],
    st.integers(4, 14), st.integers(1, 2), st.integers(4, 14), st.integers(1, 6), st.integers(3, 9))
layouts = st.one_of(
    hybrid,
    st.lists(group, min_size=1, max_size=3).filter(lambda g: any(s["kind"] != "state" for s in g)))


def run_both(real, model):
    """Both succeed (returning results) or raise the same type, and a group's
    refusal names the same group."""
    try:
        expected = model()
    except kvpool.KVPoolError as e:
        try:
            real()
        except kvpool.KVPoolError as got:
            assert isinstance(got, type(e).__mro__[1] if hasattr(e, "group") else type(e)), (got, e)
            if hasattr(e, "group"):
                assert re.search(rf"\bgroup {e.group}\b", str(got)), (str(got), e.group)
            return None
        raise AssertionError(f"model raised {e!r}, allocator succeeded") from e
    return real(), expected


class GroupsMachine(RuleBasedStateMachine):
    @initialize(specs=layouts, anchor_pages=st.sampled_from([100, 4, 8]))
    def setup(self, specs, anchor_pages):
        try:
            self.a = GroupedAllocator(specs, MAX_REQ, MAX_CTX, anchor_pages=anchor_pages)
        except kvpool.InvalidArgumentError:
            self.a = None  # a checkpoint interval the anchor page size does not divide
            return
        h = int(self.a.open(1)[0])
        self.a.close([h])
        self.m = GroupsModel(specs, h >> 32, anchor_pages)
        self.m.anchor.gen[0] = h >> 32
        self.kinds = [s["kind"] for s in self.a.groups]
        self.issued = [-3, h]

    def live(self):
        return [h for h in self.issued if self.m.anchor.row(h) is not None]

    def pick(self, data, n):
        open_ = self.live()
        hs = data.draw(st.lists(st.sampled_from(open_), unique=True, min_size=1, max_size=n)) if open_ else []
        if data.draw(st.integers(0, 5)) == 0:
            hs.insert(data.draw(st.integers(0, len(hs))), data.draw(st.sampled_from(self.issued)))
        return hs

    def tokens(self, data, hs, cs):
        out, x = [], data.draw(st.integers(0, 10))
        for h, c in zip(hs, cs):
            r = self.m.anchor.row(h)
            q = self.m.anchor.reqs[r] if r is not None else None
            for j in range(max(c, 0)):
                x = (x * 7 + 3) % 11
                pos = len(q.tokens) + j if q else 0
                out.append(q.prompt[pos] if q and pos < len(q.prompt) else x % 3)
        return out

    def prompt(self, data):
        p = list(BASES[data.draw(st.integers(0, 1))][: data.draw(st.integers(0, MAX_CTX))])
        if p and data.draw(st.integers(0, 4)) == 0:
            p[-1] = (p[-1] + 1) % 3
        return p

    @rule(n=st.integers(1, 2))
    def open(self, n):
        if self.a is None:
            return
        r = run_both(lambda: self.a.open(n), lambda: self.m.open(n))
        if r:
            assert r[0].tolist() == r[1]
            self.issued += r[1]

    @rule(data=st.data(), salt=st.integers(0, 1))
    def open_with_prefix(self, data, salt):
        if self.a is None:
            return
        prompts = [self.prompt(data) for _ in range(data.draw(st.integers(1, 2)))]
        flat = [t for p in prompts for t in p]
        r = run_both(lambda: self.a.open_with_prefix(flat, [len(p) for p in prompts], salt),
                     lambda: self.m.open_with_prefix(prompts, salt))
        if r:
            (hs, cached), (mhs, mcached) = r
            assert hs.tolist() == mhs and cached.tolist() == mcached
            self.issued += mhs

    @rule(data=st.data(), salt=st.integers(0, 1))
    def serve(self, data, salt):
        """A request served as an engine serves it: open on its hit, one token
        per step with cache() after each, close with cache."""
        if self.a is None:
            return
        p = self.prompt(data)
        r = run_both(lambda: self.a.open_with_prefix(p, [len(p)], salt),
                     lambda: self.m.open_with_prefix([p], salt))
        if not r:
            return
        (hs, cached), (mhs, _) = r
        assert hs.tolist() == mhs
        self.issued += mhs
        for t in p[int(cached[0]):]:
            if not run_both(lambda: self.a.extend(mhs, [1], [t]), lambda: self.m.extend(mhs, [1], [t])):
                break
            self.a.cache(mhs)
            self.m.cache(mhs)
        self.a.close(mhs, cache=True)
        self.m.close(mhs, cache=True)

    @rule(data=st.data(), evict=st.integers(0, 3), more=st.integers(1, 3))
    def twice(self, data, evict, more):
        """A prompt asked for again while its first request holds it: the second recomputes
        the last anchor page (a duplicate), so its chain ends on the first's entry; the first
        finishes, eviction may take that entry, and the second goes on and caches (its chain
        restarts where the entry is gone, and the groups file from there again)."""
        if self.a is None:
            return
        p = self.prompt(data)
        hs = []
        for _ in range(2):
            r = run_both(lambda: self.a.open_with_prefix(p, [len(p)], 0), lambda: self.m.open_with_prefix([p], 0))
            if not r:
                return
            (h, cached), (mh, _) = r
            assert h.tolist() == mh
            self.issued += mh
            hs.append(mh)
            if not run_both(lambda: self.a.extend(mh, [len(p) - int(cached[0])]),
                            lambda: self.m.extend(mh, [len(p) - int(cached[0])])):
                return
            run_both(lambda: self.a.cache(mh), lambda: self.m.cache(mh))
        run_both(lambda: self.a.close(hs[0]), lambda: self.m.close(hs[0]))
        g = self.a.anchor_group  # (None: a token-only anchor, whose pages no group evicts)
        if g is not None:
            assert self.a.evict(g, evict) == self.m.evict(g, evict)
        toks = self.tokens(data, hs[1], [more])
        if run_both(lambda: self.a.extend(hs[1], [more], toks), lambda: self.m.extend(hs[1], [more], toks)):
            run_both(lambda: self.a.cache(hs[1]), lambda: self.m.cache(hs[1]))

    @rule(data=st.data(), with_tokens=st.booleans())
    def extend(self, data, with_tokens):
        if self.a is None:
            return
        hs = self.pick(data, 3)
        cs = [data.draw(st.integers(-1, 5) if data.draw(st.integers(0, 9)) == 0 else st.integers(1, 4)) for _ in hs]
        toks = self.tokens(data, hs, cs) if with_tokens else None
        r = run_both(lambda: self.a.extend(hs, cs, toks), lambda: self.m.extend(hs, cs, toks))
        if r:
            assert [x.tolist() for x in r[0]] == r[1]

    @rule(data=st.data())
    def step(self, data):
        if self.a is None:
            return
        hs = self.pick(data, 3)
        toks = self.tokens(data, hs, [1] * len(hs))
        if run_both(lambda: self.a.extend(hs, 1, toks), lambda: self.m.extend(hs, [1] * len(hs), toks)):
            self.a.cache(hs)
            self.m.cache(hs)

    @rule(cs=st.lists(st.integers(0, 5), max_size=2))
    def admit(self, cs):
        if self.a is None:
            return
        r = run_both(lambda: self.a.admit(cs), lambda: self.m.admit(cs))
        if r:
            (hs, outs), (mhs, mouts) = r
            assert hs.tolist() == mhs and [x.tolist() for x in outs] == mouts
            self.issued += mhs

    @rule(data=st.data())
    def truncate(self, data):
        if self.a is None:
            return
        hs = self.pick(data, 2)
        ls = []
        for h in hs:
            r = self.m.anchor.row(h)
            n = self.m.length(r) if r is not None else 0
            ls.append(data.draw(st.integers(-1, n + 1) if data.draw(st.integers(0, 9)) == 0 else st.integers(0, n)))
        run_both(lambda: self.a.truncate(hs, ls), lambda: self.m.truncate(hs, ls))

    @rule(data=st.data())
    def roll_back_extend(self, data):
        """Truncate that keeps the prompts: the next extend takes the prompt's ids again."""
        if self.a is None:
            return
        hs = self.pick(data, 2)
        ls = []
        for h in hs:
            r = self.m.anchor.row(h)
            n = self.m.length(r) if r is not None else 0
            ls.append(data.draw(st.integers(0, n)))
        run_both(lambda: self.a.roll_back_extend(hs, ls), lambda: self.m.roll_back_extend(hs, ls))

    @rule(data=st.data())
    def rewind(self, data):
        """Truncate to the last position a state group checkpointed."""
        if self.a is None or not self.live():
            return
        h = data.draw(st.sampled_from(self.live()))
        r = self.m.anchor.row(h)
        regs, a = self.m.anchor.regs[r], self.m.a
        states = [e for e in self.m.groups if hasattr(e, "live")]
        ls = [n for n in range(1, self.m.length(r)) if n % a == 0 and len(regs) * a >= n
              and states and states[0].checkpoint(regs[n // a - 1]) is not None]
        if ls:
            run_both(lambda: self.a.truncate([h], ls[-1]), lambda: self.m.truncate([h], [ls[-1]]))

    @rule(data=st.data(), cache=st.booleans())
    def close(self, data, cache):
        if self.a is None:
            return
        hs = self.pick(data, 2)
        run_both(lambda: self.a.close(hs, cache=cache), lambda: self.m.close(hs, cache))

    @rule(data=st.data())
    def cache(self, data):
        if self.a is None:
            return
        hs = self.pick(data, 2)
        run_both(lambda: self.a.cache(hs), lambda: self.m.cache(hs))

    @rule(data=st.data(), n=st.integers(1, 2))
    def fork(self, data, n):
        if self.a is None:
            return
        h = data.draw(st.sampled_from(self.issued))
        r = run_both(lambda: self.a.fork(h, n), lambda: self.m.fork(h, n))
        if r:
            assert r[0].tolist() == r[1]
            self.issued += r[1]

    @rule(g=st.integers(0, 2), n=st.integers(0, 3))
    def evict(self, g, n):
        if self.a is None or g >= self.a.num_groups:
            return
        assert self.a.evict(g, n) == self.m.evict(g, n)

    @rule(g=st.integers(0, 2))
    def drain(self, g):
        if self.a is None or g >= self.a.num_groups:
            return
        src, dst = self.a.take_copies(g)
        assert (src.tolist(), dst.tolist()) == tuple(map(list, self.m.take_copies(g)))

    @rule()
    def clear_cache(self):
        if self.a is None:
            return
        self.a.clear_cache()
        self.m.clear_cache()

    @rule()
    def reset(self):
        if self.a is None:
            return
        self.a.reset()
        self.m.reset()

    @invariant()
    def agrees_with_model(self):
        if getattr(self, "a", None) is None:
            return
        self.a.check()
        assert self.a.open_requests == len(self.m.anchor.reqs)
        assert (self.a.hit_tokens, self.a.miss_tokens) == (self.m.anchor.hit, self.m.anchor.miss)
        for g in range(self.a.num_groups):
            got = (self.a.free_pages(g), self.a.cached_pages(g), self.a.evictable_pages(g), self.a.pending_copies(g))
            assert got == self.m.counters(g), (g, got, self.m.counters(g))
        for h in self.issued:
            r = self.m.anchor.row(h)
            assert self.a.is_open(h) == (r is not None)
            if r is None:
                continue
            assert self.a.length(h) == self.m.length(r)
            for g, kind in enumerate(self.kinds):
                if kind == "state":
                    assert self.a.state_slots([h], g).tolist() == [self.m.groups[g].live[r]]
                else:
                    assert self.a.slots(h, g).tolist() == self.m.slots(g, r)


@pytest.mark.parametrize(("window", "cut"), [(1, 1), (2, 3), (3, 4)])
def test_a_truncate_that_takes_window_pages_back_from_the_cache_agrees_with_the_model(window, cut):
    """A request opened on a cached prefix holds only the window before its hit; truncating it
    further back takes the pages the new window needs from the cache (the serve that cached
    them checkpointed the state at every length)."""
    machine = GroupsMachine()
    machine.setup(specs=[{"kind": "full", "num_pages": 16, "page_size": 1},
                         {"kind": "sliding", "num_pages": 16, "page_size": 1, "window": window},
                         {"kind": "state", "num_slots": 16, "checkpoint_every": 0}], anchor_pages=100)
    a, m = machine.a, machine.m
    prompt = BASES[0][:9]
    hs = a.open_with_prefix(prompt, [9], 0)[0].tolist()
    assert m.open_with_prefix([prompt], 0)[0] == hs
    for t in prompt:
        a.extend(hs, [1], [t])
        m.extend(hs, [1], [t])
        a.cache(hs)
        m.cache(hs)
    a.close(hs, cache=True)
    m.close(hs, cache=True)
    longer = prompt + [0]
    (hs, cached) = a.open_with_prefix(longer, [10], 0)
    (mhs, mcached) = m.open_with_prefix([longer], 0)
    assert hs.tolist() == mhs and cached.tolist() == mcached == [9]
    machine.issued += mhs
    assert run_both(lambda: a.truncate(mhs, cut), lambda: m.truncate(mhs, [cut]))
    machine.agrees_with_model()
    assert a.length(mhs[0]) == cut


GroupsMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)
TestGroupsMachine = GroupsMachine.TestCase
