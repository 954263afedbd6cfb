"""Rules of the allocator state machine (test_allocator_stateful.py) for
retention priorities: cache / close with a priority (per request or for all,
pins past the bound, durations, bad values), unpin, and the manual clock.
A mixin: AllocatorMachine holds the allocator, the model and the helpers
these rules call."""

from allocator_machine_calls import run_both, serve_prompt
from allocator_model import MAX_CTX
from hypothesis import strategies as st
from hypothesis.stateful import rule


class PriorityRules:
    @rule(data=st.data(), close=st.booleans(), per_request=st.booleans(),
          retain=st.sampled_from([None, None, 1, 2, 0.5, 0, -1]))
    def cache_with_priority(self, data, close, per_request, retain):
        """cache / close(cache=True) with a retention priority: pins often (past
        the bound they are given 99), durations, now and then a bad one."""
        hs = self.pick(data, 2)
        self.give_priority(data, hs, close, per_request, retain)

    @rule(data=st.data(), base=st.integers(0, 1), length=st.integers(1, MAX_CTX), close=st.booleans(),
          retain=st.sampled_from([None, None, 1, 2, 0.5]))
    def serve_with_priority(self, data, base, length, close, retain):
        """A request on a prompt (its token ids known, so its pages can be
        cached), prefilled, then cached or closed with a priority."""
        h = serve_prompt(self, base, length)
        if h is not None:
            self.give_priority(data, [h], close, False, retain)

    def give_priority(self, data, hs, close, per_request, retain):
        q = st.sampled_from([100, 100, 100, 35, 0, 10, 60, 99, 101, -1])
        if per_request:
            n = len(hs) + (data.draw(st.integers(0, 9)) == 0)  # now and then one too many
            priority = data.draw(st.lists(q, min_size=n, max_size=n))
        else:
            priority = data.draw(st.one_of(q, q, q, st.none()))
        if close:
            run_both(lambda: self.a.close(hs, cache=True, priority=priority, retain_s=retain),
                     lambda: self.m.close_priority(hs, True, priority, retain))
        else:
            run_both(lambda: self.a.cache(hs, priority=priority, retain_s=retain),
                     lambda: self.m.cache_priority(hs, priority, retain))

    @rule(data=st.data())
    def unpin(self, data):
        hs = self.pick(data, 2)
        r = run_both(lambda: self.a.unpin(hs), lambda: self.m.unpin(hs))
        if r:
            assert r[0] == r[1]

    @rule(tick=st.sampled_from([0, 0.5, 1, 2]))
    def set_clock(self, tick):
        self.now += tick
        self.a.set_clock(self.now)
        self.m.set_clock(round(self.now * 1e9))
