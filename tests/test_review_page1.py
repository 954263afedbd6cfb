"""Outside checker at page size 1 (SGLang's default), page 2 alongside: random
operation sequences against SlotAllocator, judged by two plain references that
know nothing of the allocator's policies:

- a content store: what K/V each slot holds, written as the pool hands slots out
  (and as take_copies moves them), keyed by (salt, every token up to and
  including the position), or by a fresh id where a token is unknown. Every
  open request must read back its own positions' keys: a prefix hit, a fork or
  a copy-on-write that hands out the wrong slot fails this.
- a router fed only by take_events(): the chain hashes stored on the device,
  each with the page and the (salt, tokens) the event chain spells. Its pages
  must hold what it says, its size must be cached_pages, and open_with_prefix
  must return exactly its longest chain (capped one token short), on its pages.
"""

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from review_page1_refs import Req, Router, Twin, prompts, snapshot

import kvpool
from kvpool import SlotAllocator

MAX_REQ, MAX_CTX = 6, 16


class Page1Machine(RuleBasedStateMachine):
    @initialize(num_pages=st.sampled_from([4, 6, 10, 16, 24]), ps=st.sampled_from([1, 1, 1, 2]),
                twin=st.sampled_from([{"kv_events": False}, {"lazy_metadata": True}]),
                host=st.sampled_from([0, 0, 3, 8]), policy=st.sampled_from(["write_back", "write_through"]))
    def setup(self, num_pages, ps, twin, host, policy):
        self.ps, self.host = ps, host
        kw = dict(hash_seed=7, handle_seed=3, host_pages=host, host_policy=policy)
        self.a = Twin(SlotAllocator(num_pages, ps, MAX_REQ, MAX_CTX, **kw),
                      SlotAllocator(num_pages, ps, MAX_REQ, MAX_CTX, **kw, **twin))
        self.router = Router(ps)
        self.host_router = Router(ps, medium=1, spelled=self.router.spelled)
        self.host_content, self.swapped = {}, set()
        self.content = {}  # slot -> key
        self.reqs = {}  # handle -> Req

    # ----- helpers
    def pick(self, data):
        return data.draw(st.sampled_from(sorted(set(self.reqs) - self.swapped)))

    def orphaned(self, salt, prompt, c, pages):
        """Known gap: an entry whose parent was removed stays stored but is never hit,
        even under a re-registered parent (test_orphan_child_advertised_but_never_hit)."""
        removed = self.router.removed
        return c < pages * self.ps and any((salt, tuple(prompt[:e])) in removed
                                           for e in range(self.ps, pages * self.ps + 1, self.ps))

    def live(self):
        return set(self.reqs) - self.swapped

    def drain(self):
        """Runs the queued transfers in the documented order: offloads, loads, copies."""
        ps = self.ps
        for src, dst, to_host in ((*self.a.take_offloads(), True), (*self.a.take_loads(), False)):
            frm, to = (self.content, self.host_content) if to_host else (self.host_content, self.content)
            for s, d in zip(src.tolist(), dst.tolist()):
                for j in range(ps):
                    to[d * ps + j] = frm.get(s * ps + j)
        src, dst = self.a.take_copies()
        for s, d in zip(src.tolist(), dst.tolist()):
            self.content[d] = self.content.get(s)
        ev = self.a.take_events()
        self.router.feed(ev)
        self.host_router.feed(ev)

    def write(self, h, slots, start):
        r = self.reqs[h]
        others = {s for o in self.live() if o != h for s in self.a.slots(o).tolist()}
        for j, s in enumerate(slots):
            assert s not in others, f"slot {s} handed to {h} is held by another request"
            self.content[s] = r.keys[start + j]

    def refused(self, call, before):
        with pytest.raises(kvpool.KVPoolError):
            call()
        assert snapshot(self.a, sorted(self.live())) == before
        self.a.check()

    # ----- rules
    @precondition(lambda self: len(self.reqs) < MAX_REQ)
    @rule(data=st.data(), salt=st.sampled_from([0, 0, 1]),
          prompt=prompts)
    def open_prompt(self, data, salt, prompt):
        expect = self.router.longest(salt, prompt[:len(prompt) - 1])
        hs, cached = self.a.open_with_prefix(prompt, [len(prompt)], salt=salt)
        h, c = int(hs[0]), int(cached[0])
        if self.host:  # a host hit may find no device page: a shorter match
            assert c <= len(self.router.longest(salt, prompt[:-1], also=self.host_router)) * self.ps
        elif not self.orphaned(salt, prompt, c, len(expect)):
            assert c == len(expect) * self.ps, (c, expect)
            assert self.a.pages(h).tolist() == expect
        self.reqs[h] = Req.hit(salt, prompt, c)
        # Mostly the whole prompt, then published: later prompts have something to hit.
        n = len(prompt) - c if data.draw(st.integers(0, 3)) else data.draw(st.integers(0, len(prompt) - c))
        self.extend_by(h, n, data.draw(st.booleans()))
        if data.draw(st.booleans()) and self.a.length(h) == len(prompt):
            self.a.cache([h])

    @precondition(lambda self: len(self.reqs) < MAX_REQ)
    @rule(counts=st.lists(st.integers(0, 4), min_size=1, max_size=2), with_tokens=st.booleans())
    def admit(self, counts, with_tokens):
        counts = counts[:MAX_REQ - len(self.reqs)]
        toks = [(i * 5 + len(counts)) % 3 + 1 for i in range(sum(counts))]
        if sum(-(-c // self.ps) for c in counts) > self.a.free_pages:
            return
        hs, slots = self.a.admit(counts, tokens=toks if with_tokens else None)
        off = 0
        for h, c in zip(hs.tolist(), counts):
            r = self.reqs[h] = Req(0)
            for i in range(c):
                t = toks[off + i] if with_tokens else None
                r.toks.append(t)
                r.keys.append(r.key_at(i, t))
            self.drain()
            self.write(h, slots[off:off + c].tolist(), 0)
            off += c

    @precondition(lambda self: self.live())
    @rule(data=st.data(), n=st.integers(0, 5), with_tokens=st.booleans(), packed=st.booleans())
    def extend(self, data, n, with_tokens, packed):
        self.extend_by(self.pick(data), n, with_tokens, packed)

    def extend_by(self, h, n, with_tokens, packed=False):
        r, start = self.reqs[h], self.a.length(h)
        toks = []
        for i in range(start, start + n):
            if i < len(r.prompt):
                toks.append(r.prompt[i])
            else:
                toks.append((i * 7 + start) % 3 + 1 if with_tokens else None)
        before = snapshot(self.a, sorted(self.live()))
        need = -(-(start + n) // self.ps) - -(-start // self.ps)
        given = toks if with_tokens else None
        if start + n > MAX_CTX or need + (1 if self.ps > 1 else 0) > self.a.free_pages:
            try:
                slots = self.a.extend([h], [n], tokens=given)
            except (kvpool.PoolExhaustedError, kvpool.ContextTooLongError):
                assert snapshot(self.a, sorted(self.live())) == before
                return
        elif packed:  # [rows | starts | counts | offsets], each 2 long for one request, then the slots
            buf, b, cow = self.a.extend_packed([h], [n], tokens=given)
            assert b == 1 and buf[2] == start and buf[4] == n
            slots = buf[8:8 + n]
            if cow is not None:  # handed back here, not queued: [rows | positions | src | dst]
                m = len(cow) // 4
                for s, d in zip(cow[2 * m:3 * m].tolist(), cow[3 * m:].tolist()):
                    self.content[d] = self.content.get(s)
        else:
            slots = self.a.extend([h], [n], tokens=given)
        for i, t in enumerate(toks):
            r.toks.append(t)
            r.keys.append(r.key_at(start + i, t))
        self.drain()
        self.write(h, slots.tolist(), start)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def cache(self, data):
        h = self.pick(data)
        self.a.cache([h])
        self.drain()
        r = self.reqs[h]
        known = self.a.known_tokens(h).tolist()
        assert known == [t for t in itertools.takewhile(lambda t: t is not None, r.toks)]
        full = len(known) // self.ps
        # On either tier: a request's page whose entry is host-only stays so (see
        # test_swap_in_reloads_a_page_still_cached_on_the_device in test_review_page1_pool.py).
        stored = {v[1] for v in [*self.router.entries.values(), *self.host_router.entries.values()]}
        for k in range(1, full + 1):
            key = (r.salt, tuple(known[:k * self.ps]))
            if key not in stored:
                # Known gap: a chain whose tip entry (a duplicate's) was evicted stops for
                # good (test_duplicate_tip_evicted_stops_publishing in test_review_page1_pool.py).
                assert key in self.router.removed | self.host_router.removed, key
                break

    @precondition(lambda self: self.live())
    @rule(data=st.data(), pin=st.booleans())
    def pin_or_unpin(self, data, pin):
        h = self.pick(data)
        if pin:
            self.a.cache([h], priority=100)
        else:
            self.a.unpin([h])
        self.drain()

    @precondition(lambda self: self.live())
    @rule(data=st.data(), cache=st.booleans())
    def close(self, data, cache):
        h = data.draw(st.sampled_from(sorted(self.reqs)))
        self.a.close([h], cache=cache and h not in self.swapped)
        del self.reqs[h]
        self.swapped.discard(h)
        self.drain()
        self.refused(lambda: self.a.close([h]), snapshot(self.a, sorted(self.live())))

    @precondition(lambda self: self.live() and len(self.reqs) < MAX_REQ)
    @rule(data=st.data())
    def fork(self, data):
        h = self.pick(data)
        n = data.draw(st.integers(1, MAX_REQ - len(self.reqs)))
        kids = self.a.fork(h, n)
        for k in kids.tolist():
            self.reqs[int(k)] = self.reqs[h].copy()
            assert self.a.slots(k).tolist() == self.a.slots(h).tolist()
        self.drain()

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def truncate(self, data):
        h = self.pick(data)
        r = self.reqs[h]
        n = data.draw(st.integers(0, len(r.keys)))
        self.a.truncate([h], [n])
        if n < len(r.keys):  # only a shortening forgets the prompt past the cut
            del r.prompt[n:]
        del r.keys[n:], r.toks[n:]
        self.drain()

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def roll_back(self, data):
        h = self.pick(data)
        r = self.reqs[h]
        n = data.draw(st.integers(0, len(r.keys)))
        self.a.roll_back_extend([h], [n])  # as truncate, but the prompt stays
        del r.keys[n:], r.toks[n:]
        self.drain()

    @precondition(lambda self: self.host and self.live())
    @rule(data=st.data())
    def swap_out(self, data):
        h = self.pick(data)
        try:
            self.a.swap_out([h])
        except kvpool.PoolExhaustedError:
            return
        self.swapped.add(h)
        self.drain()

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        h = data.draw(st.sampled_from(sorted(self.swapped)))
        try:
            self.a.swap_in([h])
        except kvpool.PoolExhaustedError:
            return
        self.swapped.discard(h)
        self.drain()

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        evictable, pinned = self.a.evictable_pages, self.a.pinned_pages
        assert self.a.evict(n) == min(n, evictable)
        assert self.a.pinned_pages == pinned
        self.drain()

    @rule(now=st.integers(0, 4))
    def clear_cache(self, now):
        if now:  # seldom: it empties what later prompts would hit
            return
        self.a.clear_cache()
        self.drain()
        assert not self.router.entries and self.a.pinned_pages == 0

    @precondition(lambda self: self.live())
    @rule(data=st.data(), bad=st.sampled_from(["len", "neg", "tok", "dup", "stale", "trunc", "ctx"]))
    def bad_input(self, data, bad):
        h = self.pick(data)
        a, n = self.a, self.a.length(h)
        before = snapshot(a, sorted(self.live()))
        call = {
            "len": lambda: a.extend([h], [2], tokens=[1]),
            "neg": lambda: a.extend([h], [-1]),
            "tok": lambda: a.extend([h], [1], tokens=[-5]),
            "dup": lambda: a.extend([h, h], [1, 1]),
            "stale": lambda: a.extend([h + (1 << 32)], [1]),
            "trunc": lambda: a.truncate([h], [n + 1]),
            "ctx": lambda: a.extend([h], [MAX_CTX - n + 1]),
        }[bad]
        self.refused(call, before)

    # ----- invariants
    @invariant()
    def agrees(self):
        if not hasattr(self, "a"):
            return
        a, ps = self.a, self.ps
        a.check()
        self.drain()
        held = set()
        for h, r in self.reqs.items():
            assert a.length(h) == len(r.keys)
            if h in self.swapped:
                continue
            slots = a.slots(h).tolist()
            assert a.length(h) == len(r.keys) == len(slots)
            assert len(set(slots)) == len(slots) and 0 not in slots
            got = [self.content.get(s) for s in slots]
            assert got == r.keys, f"request {h} reads K/V written for other tokens"
            pages = a.pages(h).tolist()
            held |= set(pages)
            assert pages == sorted(set(s // ps for s in slots), key=[s // ps for s in slots].index)
            indptr, indices, last = a.page_table([h])
            assert indptr.tolist() == [0, len(pages)] and indices.tolist() == pages
            assert last.tolist() == [(len(slots) - 1) % ps + 1 if slots else 0]
        if self.reqs:
            rows = a.rows(sorted(self.reqs)).tolist()
            assert len(set(rows)) == len(rows) and all(0 <= x < MAX_REQ for x in rows)
        assert a.cached_pages == len(self.router.entries)
        assert a.host_cached_pages == len(self.host_router.entries)
        for p, (salt, prefix) in self.host_router.entries.values():
            for j in range(ps):
                assert self.host_content.get(p * ps + j) == (salt, prefix[:len(prefix) - ps + j + 1]), \
                    f"host page {p} does not hold the tokens its Stored event named"
        if self.swapped:  # their device pages are not listed: the counters below need them
            return
        assert a.used_pages == len(held)
        pages = {p for p, _ in self.router.entries.values()}
        assert len(pages) == len(self.router.entries), "two stored hashes on one page"
        pinned_idle = len(pages - held) - a.evictable_pages  # cached, held by nobody, pinned
        assert 0 <= pinned_idle <= a.pinned_pages <= len(pages)
        assert a.free_pages + a.used_pages + pinned_idle == a.capacity_pages
        for p, (salt, prefix) in self.router.entries.values():
            start = len(prefix) - ps
            for j in range(ps):
                assert self.content.get(p * ps + j) == (salt, prefix[:start + j + 1]), \
                    f"cached page {p} does not hold the tokens its Stored event named"


Page1Machine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestPage1Allocator = Page1Machine.TestCase
