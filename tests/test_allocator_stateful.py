"""Hypothesis state machine: the Rust allocator against a pure-Python model
(tests/allocator_model.py), shared pages and a host tier included:
open_with_prefix (host hits too), extend(tokens=), admit, cache, close(cache=),
fork with copy-on-write, truncate into shared pages and into prompts (which then
diverge), evict (write_back offloads), clear_cache, reset, eviction under
pressure, swap_out and swap_in, and retention priorities (cache / close with a
priority, per request or for all, pins past a small bound, durations on a manual
clock, unpin), with and without a host tier. After every step the two must agree
on every query (slots, pages, known tokens, counters of both tiers, queued
copies, offloads and loads, hit counts, pinned pages, evictable pages per
priority), and check() must pass. Errors must agree in type and leave both
unchanged.

Some runs drain the transfer queues after every step; the others only when the
`drain` rule fires or a step writes a slot a queued transfer touches, so queued
transfers outlive closes, truncations, evictions, swaps and resets: the model
knows which survive and which pages they keep held. A simulated store
(tests/allocator_store.py) runs what each drain hands out in the documented order
(offloads, loads, copies): every open request must read exactly what it wrote or
was served, and every swapped-out request's host pages must hold it."""

import copy

import numpy as np
import pytest
from allocator_machine_calls import BASES, run_both
from allocator_model import MAX_CTX, MAX_REQ, Model
from allocator_rules_priorities import PriorityRules
from allocator_rules_scenarios import ScenarioRules
from allocator_store import Store
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kvpool
from kvpool import SlotAllocator


class AllocatorMachine(ScenarioRules, PriorityRules, RuleBasedStateMachine):
    @initialize(num_pages=st.integers(2, 40), ps=st.sampled_from([1, 2, 3, 4]), drain_always=st.booleans(),
                host_pages=st.sampled_from([0, 0, 2, 3, 5, 8, 16]),
                policy=st.sampled_from(["write_back", "write_through"]),
                max_pinned=st.sampled_from([0, 1, 1, 2, 3]))
    def setup(self, num_pages, ps, drain_always, host_pages, policy, max_pinned):
        max_pinned = min(max_pinned, num_pages - 1)
        self.a = SlotAllocator(num_pages, ps, MAX_REQ, MAX_CTX, host_pages=host_pages, host_policy=policy,
                               manual_clock=True, max_pinned_pages=max_pinned)
        self.now = 0.0
        self.drain_always = drain_always
        # Generations start at a random per-allocator base: learn it from a
        # throwaway request (row 0 goes back on top of the row stack).
        h = int(self.a.open(1)[0])
        self.a.close([h])
        self.m = Model(num_pages, ps, gen_base=h >> 32, host_pages=host_pages, policy=policy,
                       max_pinned=max_pinned)
        self.store = Store(num_pages, host_pages, ps)
        self.texts = []  # (known tokens, salt) of requests that registered pages
        self.m.gen[0] = h >> 32
        self.issued = [-3, (7 << 32) | 2, h]  # never-issued and closed handles ride along

    def open_handles(self):
        return [h for h in self.issued if self.m.row(h) is not None]

    def pick(self, data, n):
        """Distinct open handles, and now and then one more from every handle
        ever issued (stale, closed, bogus or a duplicate) so errors get tested."""
        open_ = self.open_handles()
        hs = data.draw(st.lists(st.sampled_from(open_), unique=True, min_size=1, max_size=n)) if open_ else []
        if data.draw(st.integers(0, 4)) == 0:
            hs.insert(data.draw(st.integers(0, len(hs))), data.draw(st.sampled_from(self.issued)))
        return hs

    @rule(n=st.integers(1, 2))
    def open(self, n):
        r = run_both(lambda: self.a.open(n), lambda: self.m.open(n))
        if r:
            assert r[0].tolist() == r[1]
            self.issued += r[1]

    @rule(data=st.data(), salt=st.integers(0, 1))
    def open_with_prefix(self, data, salt):
        prompts = []
        for _ in range(data.draw(st.integers(1, 2))):
            p = list(BASES[data.draw(st.integers(0, 1))][: data.draw(st.integers(0, MAX_CTX + 1))])
            if p and data.draw(st.integers(0, 4)) == 0:
                p[-1] = (p[-1] + 1) % 3
            prompts.append(p)
        flat = [t for p in prompts for t in p]
        lens = [len(p) for p in prompts]
        r = run_both(lambda: self.a.open_with_prefix(flat, lens, salt),
                     lambda: self.m.open_with_prefix(prompts, salt))
        if r:
            (hs, cached), (mhs, mcached) = r
            assert hs.tolist() == mhs and cached.tolist() == mcached
            self.issued += mhs
            for h, n in zip(mhs, mcached):
                self.store.hit(self.m, h, n)

    def tokens_for(self, data, hs, cs):
        out, x = [], data.draw(st.integers(0, 10))
        for h, c in zip(hs, cs):
            r = self.m.row(h)
            q = self.m.reqs[r] if r is not None else None
            for j in range(max(c, 0)):
                x = (x * 7 + 3) % 11
                pos = len(q.tokens) + j if q else 0
                out.append(q.prompt[pos] if q and pos < len(q.prompt) else x % 3)
        if out and data.draw(st.integers(0, 19)) == 0:
            out[-1] = -1 if data.draw(st.booleans()) else out[-1] + 1  # a bad id
        return out

    @rule(data=st.data(), as_array=st.booleans(), with_tokens=st.booleans(), with_out=st.booleans())
    def extend(self, data, as_array, with_tokens, with_out):
        hs = self.pick(data, 4)
        grow = st.integers(1, 6)  # hypothesis favours 0 and [] heavily; make most steps do work
        count = st.one_of(grow, grow, grow, st.integers(0, 6), st.just(-1))
        cs = data.draw(st.lists(count, min_size=len(hs), max_size=len(hs)))
        toks = self.tokens_for(data, hs, cs) if with_tokens else None
        arg = np.array(hs, dtype=np.int64) if as_array else hs
        # out=: a step buffer with room to spare; written only on success.
        out = np.full(sum(max(c, 0) for c in cs) + 2, -5, dtype=np.int64) if with_out else None
        r = run_both(lambda: self.a.extend(arg, cs, tokens=toks, out=out), lambda: self.m.extend(hs, cs, toks))
        if r:
            got = r[0]
            if out is not None:
                assert got is out and (out[len(r[1]) :] == -5).all()
                got = out[: len(r[1])]
            assert got.tolist() == r[1]
            self.write(hs)
        elif out is not None:
            assert (out == -5).all()

    def model_admit(self, cs, toks):
        """open + extend on the model, all or nothing."""
        saved = copy.deepcopy(self.m.__dict__)
        try:
            hs = self.m.open(len(cs))
            return hs, self.m.extend(hs, cs, toks)
        except kvpool.KVPoolError:
            self.m.__dict__.clear()
            self.m.__dict__.update(saved)
            raise

    @rule(data=st.data(), with_tokens=st.booleans(), with_out=st.booleans())
    def admit(self, data, with_tokens, with_out):
        """open + extend in one call; refused, it must leave even the next handles alone."""
        grow = st.integers(1, 6)
        cs = data.draw(st.lists(st.one_of(grow, grow, st.integers(0, 6), st.just(-1)), max_size=3))
        n = sum(max(c, 0) for c in cs)
        toks = [(7 * j + 3) % 3 for j in range(n)] if with_tokens else None
        if toks and data.draw(st.integers(0, 9)) == 0:
            toks[-1] = -1  # a bad id
        out = np.full(n + 2, -5, dtype=np.int64) if with_out else None
        r = run_both(lambda: self.a.admit(cs, tokens=toks, out=out), lambda: self.model_admit(cs, toks))
        if r:
            (hs, slots), (mhs, mslots) = r
            if out is not None:
                assert slots is out and (out[len(mslots):] == -5).all()
                slots = out[: len(mslots)]
            assert hs.tolist() == mhs and slots.tolist() == mslots
            self.issued += mhs
            self.write(mhs)
        elif out is not None:
            assert (out == -5).all()

    @rule(data=st.data())
    def prefill(self, data):
        """Extends a request by the rest of its prompt (the ids come from it)."""
        open_ = self.open_handles()
        if not open_:
            return
        h = data.draw(st.sampled_from(open_))
        q = self.m.reqs[self.m.row(h)]
        c = max(len(q.prompt) - len(q.tokens), 0)
        r = run_both(lambda: self.a.extend([h], [c]), lambda: self.m.extend([h], [c]))
        if r:
            assert r[0].tolist() == r[1]
            self.write([h])

    @rule(data=st.data())
    def grow_every_open_request(self, data):
        """Long requests make truncate/close free several pages at once; under
        pressure extend evicts cached pages."""
        hs = self.open_handles()
        cs = data.draw(st.lists(st.integers(1, 8), min_size=len(hs), max_size=len(hs)))
        r = run_both(lambda: self.a.extend(np.array(hs, dtype=np.int64), cs), lambda: self.m.extend(hs, cs))
        if r:
            assert r[0].tolist() == r[1]
            self.write(hs)

    @rule(data=st.data())
    def truncate(self, data):
        hs = self.pick(data, 3)
        ls = []
        for h in hs:  # mostly valid new lengths (so pages really get freed), sometimes not
            r = self.m.row(h)
            cur = len(self.m.reqs[r].tokens) if r is not None else 0
            ok = st.integers(0, cur)
            ls.append(data.draw(st.one_of(ok, ok, ok, st.sampled_from([-1, cur + 1]))))
        if run_both(lambda: self.a.truncate(hs, ls), lambda: self.m.truncate(hs, ls)):
            for h, n in zip(hs, ls):
                self.store.truncate(h, n)

    def pick_where(self, data, want):
        """One open handle for which want(request) holds, when there is one
        (or by a coin flip), else what pick() gives."""
        fit = [h for h in self.open_handles() if want(self.m.reqs[self.m.row(h)])]
        if fit and data.draw(st.booleans()):
            return [data.draw(st.sampled_from(fit))]
        return self.pick(data, 1)[:1]  # now and then not an open request

    @rule(data=st.data(), n=st.integers(0, 5), seed=st.integers(0, 2))
    def rollback(self, data, n, seed):
        """Rolls a request back, most often into its prompt, and continues it
        with other tokens: an edited turn, a retried tool call, rejected draft
        tokens."""
        hs = self.pick_where(data, lambda q: min(len(q.tokens), len(q.prompt)) > 0)
        if not hs:
            return
        r = self.m.row(hs[0])
        q = self.m.reqs[r] if r is not None else None
        keep = data.draw(st.integers(0, len(q.tokens))) if q else 0
        if q and min(len(q.tokens), len(q.prompt)) > 0 and data.draw(st.integers(0, 3)):
            keep = data.draw(st.integers(0, min(len(q.tokens), len(q.prompt)) - 1))
        if run_both(lambda: self.a.truncate(hs, [keep]), lambda: self.m.truncate(hs, [keep])):
            self.store.truncate(hs[0], keep)
        toks = [(seed + 2 * j) % 3 for j in range(n)]
        r = run_both(lambda: self.a.extend(hs, [n], tokens=toks), lambda: self.m.extend(hs, [n], toks))
        if r:
            assert r[0].tolist() == r[1]
            self.write(hs)

    def write(self, hs):
        """The step of requests hs: their new positions' K/V, after the queued
        transfers if one of them touches a slot written."""
        self.store.write(self.m, hs, self.drain)

    @rule()
    def drain(self):
        """Takes every queue in the documented order, checks each against the
        model's, and runs them on the store."""
        off = tuple(x.tolist() for x in self.a.take_offloads())
        loads = tuple(x.tolist() for x in self.a.take_loads())
        copies = tuple(x.tolist() for x in self.a.take_copies())
        assert off == tuple(self.m.take_offloads())
        assert loads == tuple(self.m.take_loads())
        assert copies == tuple(self.m.take_copies())
        self.store.run(off, loads, copies)

    @rule(now=st.integers(0, 3))
    def reset(self, now):
        if now == 0:  # rarely: it ends every request
            self.a.reset()
            self.m.reset()

    @rule(data=st.data(), cache=st.booleans())
    def close(self, data, cache):
        hs = self.pick(data, 2)
        if cache:
            self.drain()  # an engine runs its step before it publishes pages
            self.remember(hs)
        run_both(lambda: self.a.close(hs, cache=cache), lambda: self.m.close(hs, cache))

    @rule(data=st.data())
    def cache(self, data):
        hs = self.pick(data, 2)
        self.drain()
        self.remember(hs)
        run_both(lambda: self.a.cache(hs), lambda: self.m.cache(hs))

    def swapped_handles(self):
        return [h for h in self.open_handles() if self.m.reqs[self.m.row(h)].swapped]

    @rule(data=st.data())
    def swap_out(self, data):
        hs = self.pick(data, 2)
        run_both(lambda: self.a.swap_out(hs), lambda: self.m.swap_out(hs))

    @rule(data=st.data())
    def swap_in(self, data):
        swapped = self.swapped_handles()
        hs = [data.draw(st.sampled_from(swapped))] if swapped and data.draw(st.integers(0, 3)) else self.pick(data, 2)
        run_both(lambda: self.a.swap_in(hs), lambda: self.m.swap_in(hs))

    @rule(data=st.data())
    def bounce(self, data):
        """swap_out, swap_in, swap_out, swap_in with nothing drained: pages a queued
        load has yet to fill are swapped out again, host pages swap_in lets go are
        wanted by write-backs of the same call."""
        hs = self.pick(data, 1)[:1]
        for k in range(4):
            call = "swap_out" if k % 2 == 0 else "swap_in"
            if not run_both(lambda: getattr(self.a, call)(hs), lambda: getattr(self.m, call)(hs)):
                break
            self.a.check()

    @rule(data=st.data(), n=st.integers(1, 2))
    def fork(self, data, n):
        hs = self.pick(data, 1)
        if not hs:
            return
        r = run_both(lambda: self.a.fork(hs[0], n), lambda: self.m.fork(hs[0], n))
        if r:
            assert r[0].tolist() == r[1]
            self.issued += r[1]
            self.store.fork(hs[0], r[1])

    @rule(n=st.integers(0, 3))
    def evict(self, n):
        """The device pages evicted, in order (their device Removed events), are
        the model's; a write-back may also remove host copies."""
        self.a.take_events()
        self.m.victims = []
        assert self.a.evict(n) == self.m.evict(n)
        ev = self.a.take_events()
        assert ev["page"][(ev["kind"] == 1) & (ev["medium"] == 0)].tolist() == self.m.victims

    @rule()
    def clear_cache(self):
        self.a.clear_cache()
        self.m.clear_cache()

    @invariant()
    def agrees_with_model(self):
        if not hasattr(self, "a"):
            return
        self.a.check()
        if self.drain_always:
            self.drain()
            self.a.check()
        assert self.a.pending_copies == self.m.pending_copies()
        t = self.m.tier
        assert (self.a.pending_offloads, self.a.pending_loads) == ((len(t.offloads), len(t.loads)) if t else (0, 0))
        assert self.a.free_pages == len(self.m.free) + self.m.evictable()
        s = self.a.stats()
        assert (s.evictable_pages, s.cached_pages) == (self.m.evictable(), self.m.device_registered())
        assert s.pinned_pages == self.m.pinned() <= self.a.max_pinned_pages
        assert self.a.evictable_pages_by_priority().tolist() == self.m.by_priority()
        assert (s.hit_tokens, s.miss_tokens) == (self.m.hit, self.m.miss)
        assert (s.host_free_pages, s.host_cached_pages) == (self.m.host_free_pages(), self.m.host_registered())
        if t:
            assert (s.host_hit_tokens, s.offloaded_pages, s.loaded_pages) == (t.hit, t.offloaded, t.loaded)
        assert self.a.open_requests == len(self.m.reqs)
        for h in self.issued:
            r = self.m.row(h)
            assert self.a.is_open(h) == (r is not None)
            if r is not None and self.m.reqs[r].swapped:
                assert self.a.is_swapped(h)
                with pytest.raises(kvpool.RequestSwappedOutError):
                    self.a.slots(h)
                assert self.a.length(h) == len(self.m.reqs[r].tokens)
                assert self.a.known_tokens(h).tolist() == self.m.reqs[r].known()
            elif r is not None:
                assert not self.a.is_swapped(h)
                assert self.a.slots(h).tolist() == self.m.slots(r)
                assert self.a.known_tokens(h).tolist() == self.m.reqs[r].known()
        self.store.scribble(self.m)
        self.store.verify(self.m)


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
