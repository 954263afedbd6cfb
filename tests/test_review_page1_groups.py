"""Outside checker for GroupedAllocator at page size 1: a full group and a sliding
group (and at times a full group of page 2 beside them), random prefix hits,
extends, caches, closes, forks, truncates, evictions and cache clears, judged by
a content store per group (what each slot holds, written as slots are handed
out and moved by take_copies), as tests/test_review_page1.py does for one group.
Every open request must read its own positions' keys in the full groups, and in
a sliding group every position its next token attends to; no slot handed to one
request may be held by another."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from review_page1_refs import Req, prompts

import kvpool

MAX_REQ, MAX_CTX = 5, 14


class GroupsMachine(RuleBasedStateMachine):
    @initialize(n_full=st.sampled_from([4, 9, 20]), n_slide=st.sampled_from([4, 9, 20]), window=st.integers(1, 4),
                wide=st.sampled_from([None, None, 24]))
    def setup(self, n_full, n_slide, window, wide):
        self.specs = [{"kind": "full", "num_pages": n_full, "page_size": 1},
                      {"kind": "sliding", "num_pages": n_slide, "page_size": 1, "window": window}]
        if wide:
            self.specs.append({"kind": "full", "num_pages": wide, "page_size": 2})
        self.a = kvpool.GroupedAllocator(self.specs, MAX_REQ, MAX_CTX, hash_seed=11)
        self.content = [{} for _ in self.specs]
        self.reqs = {}

    def pick(self, data):
        return data.draw(st.sampled_from(sorted(self.reqs)))

    def drain(self):
        for g, c in enumerate(self.content):
            src, dst = self.a.take_copies(g)
            for s, d in zip(src.tolist(), dst.tolist()):
                c[d] = c.get(s)

    def extend_by(self, h, n, with_tokens):
        r, start = self.reqs[h], self.a.length(h)
        toks = [r.prompt[i] if i < len(r.prompt) else (i % 3 + 1 if with_tokens else None)
                for i in range(start, start + n)]
        try:
            new = self.a.extend([h], [n], tokens=toks if with_tokens else None)
        except (kvpool.PoolExhaustedError, kvpool.ContextTooLongError):
            return
        for i, t in enumerate(toks):
            r.toks.append(t)
            r.keys.append(r.key_at(start + i, t))
        self.drain()
        for g, slots in enumerate(new):
            others = {s for o in self.reqs if o != h for s in self.a.slots(o, g).tolist() if s >= 2}
            for j, s in enumerate(slots.tolist()):
                assert s not in others, f"group {g}: slot {s} handed out while another request holds it"
                self.content[g][s] = r.keys[start + j]

    @precondition(lambda self: len(self.reqs) < MAX_REQ)
    @rule(data=st.data(), salt=st.sampled_from([0, 0, 4]), prompt=prompts)
    def open_prompt(self, data, salt, prompt):
        hs, cached = self.a.open_with_prefix(prompt, [len(prompt)], salt=salt)
        h, c = int(hs[0]), int(cached[0])
        assert 0 <= c < len(prompt)
        r = Req(salt, prompt)
        for i in range(c):
            r.toks.append(prompt[i])
            r.keys.append(r.key_at(i, prompt[i]))
        self.reqs[h] = r
        self.drain()
        # Mostly the whole prompt, then published: later prompts have something to hit.
        n = len(prompt) - c if data.draw(st.integers(0, 3)) else data.draw(st.integers(0, len(prompt) - c))
        self.extend_by(h, n, data.draw(st.booleans()))
        if data.draw(st.booleans()) and self.a.length(h) == len(prompt):
            self.a.cache([h])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), n=st.integers(1, 4), with_tokens=st.booleans())
    def extend(self, data, n, with_tokens):
        self.extend_by(self.pick(data), n, with_tokens)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def cache(self, data):
        self.a.cache([self.pick(data)])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), cache=st.booleans())
    def close(self, data, cache):
        h = self.pick(data)
        self.a.close([h], cache=cache)
        del self.reqs[h]
        self.drain()

    @precondition(lambda self: self.reqs and len(self.reqs) < MAX_REQ)
    @rule(data=st.data())
    def fork(self, data):
        h = self.pick(data)
        for k in self.a.fork(h, 1).tolist():
            self.reqs[int(k)] = self.reqs[h].copy()
        self.drain()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def truncate(self, data):
        h = self.pick(data)
        r = self.reqs[h]
        n = data.draw(st.integers(0, len(r.keys)))
        try:
            self.a.truncate([h], [n])
        except kvpool.RollbackUnavailableError:
            return  # a sliding window that released what the new length attends to
        if n < len(r.keys):
            del r.prompt[n:]
        del r.keys[n:], r.toks[n:]
        self.drain()

    @rule(data=st.data(), n=st.integers(0, 5))
    def evict(self, data, n):
        self.a.evict(data.draw(st.integers(0, len(self.specs) - 1)), n)

    @rule()
    def clear_cache(self):
        self.a.clear_cache()

    @invariant()
    def reads_back(self):
        if not hasattr(self, "a"):
            return
        self.a.check()
        for h, r in self.reqs.items():
            n = self.a.length(h)
            assert n == len(r.keys)
            for g, spec in enumerate(self.specs):
                slots = self.a.slots(h, g).tolist()
                assert len(slots) == n
                live = range(max(0, n - spec["window"] + 1), n) if spec["kind"] == "sliding" else range(n)
                for i in live:
                    assert self.content[g].get(slots[i]) == r.keys[i], \
                        f"group {g}: request {h} position {i} reads K/V of other tokens"


GroupsMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestPage1Groups = GroupsMachine.TestCase


def test_sliding_hit_at_page1_serves_the_window():
    g = kvpool.GroupedAllocator([{"kind": "full", "num_pages": 16, "page_size": 1},
                                 {"kind": "sliding", "num_pages": 16, "page_size": 1, "window": 3}], 4, 16,
                                hash_seed=2)
    hs, _ = g.open_with_prefix([1, 2, 3, 4, 5, 6], [6])
    g.extend(hs, [6])
    g.close(hs, cache=True)
    hs, cached = g.open_with_prefix([1, 2, 3, 4, 5, 6, 7], [7])
    assert int(cached[0]) == 6
    assert g.slots(int(hs[0]), 0).tolist() == [1, 2, 3, 4, 5, 6]
    assert g.pages(int(hs[0]), 1).tolist()[-2:] == [5, 6]
    g.check()


@pytest.mark.parametrize("bad", ["tokens", "count", "truncate", "group"])
def test_grouped_refusals_change_nothing(bad):
    g = kvpool.GroupedAllocator([{"kind": "full", "num_pages": 8, "page_size": 1},
                                 {"kind": "sliding", "num_pages": 8, "page_size": 1, "window": 2}], 3, 8)
    hs, _ = g.open_with_prefix([1, 2, 3], [3])
    g.extend(hs, [3])
    h = int(hs[0])
    before = [(g.slots(h, i).tolist(), g.free_pages(i), g.cached_pages(i)) for i in range(2)], g.length(h)
    call = {"tokens": lambda: g.extend(hs, [2], tokens=[1]), "count": lambda: g.extend(hs, [9]),
            "truncate": lambda: g.truncate(hs, [5]), "group": lambda: g.evict(5, 1)}[bad]
    with pytest.raises(kvpool.KVPoolError):
        call()
    assert ([(g.slots(h, i).tolist(), g.free_pages(i), g.cached_pages(i)) for i in range(2)], g.length(h)) == before
    g.check()
