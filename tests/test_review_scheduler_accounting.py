"""What a scheduler reads from the pool, checked against what the pool then does.

A serving engine's scheduler decides a step from queries (``free_pages``,
``evictable_pages``, ``admissible_tokens``, a prefix-hit preview through
``page_hashes`` + ``match_chain_hashes``) and then calls ``admit`` /
``open_with_prefix`` / ``extend``. Random sequences on small pools (pressure,
eviction, pins, forks, copy-on-write, truncation into registered pages) check:

1. a batch the queries say fits is granted; one they say cannot fit is refused;
2. a refusal is ``PoolExhaustedError`` and leaves every query, every request and
   the event log exactly as they were (and ``check()`` passes);
3. the preview equals the hit ``open_with_prefix`` then gives;
4. the counters agree with each other and with the pages requests hold.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvpool
from kvpool import GroupedAllocator, PoolExhaustedError, SlotAllocator, TooManyRequestsError
from kvpool._core import page_hashes
from kvpool.layout import padded_table

COUNTERS = ("free_pages", "used_pages", "free_slots", "used_slots", "open_requests", "admissible_tokens",
            "metadata_bytes", "cached_pages", "evictable_pages", "hit_tokens", "miss_tokens", "pinned_pages")


def pages_for(n: int, p: int) -> int:  # ceil(n / p)
    return -(-n // p)


def snapshot(a: SlotAllocator, live: list[int]) -> tuple:
    """Everything a scheduler can read, for a before/after comparison."""
    reqs = tuple(
        (h, a.is_open(h), a.length(h), a.is_swapped(h), () if a.is_swapped(h) else tuple(a.pages(h).tolist()),
         tuple(a.known_tokens(h).tolist()))
        for h in live
    )
    counters = tuple(getattr(a, c) for c in COUNTERS)
    host = (a.host_free_pages, a.host_cached_pages, a.pending_offloads, a.pending_loads)
    return counters, host, a.pending_copies, tuple(a.evictable_pages_by_priority().tolist()), reqs


def consistent(a: SlotAllocator, live: list[int]) -> None:
    """The counters agree with each other and with the requests' pages."""
    a.check()
    p = a.page_size
    s = a.stats()
    for c in COUNTERS:
        assert getattr(s, c) == getattr(a, c), c
    assert a.free_slots == a.free_pages * p
    assert a.admissible_tokens == a.free_slots
    assert a.used_slots == a.used_pages * p
    assert a.evictable_pages == int(a.evictable_pages_by_priority().sum())
    assert a.evictable_pages <= a.free_pages and a.evictable_pages <= a.cached_pages
    assert a.open_requests == len(live)
    held, swapped = set(), 0
    for h in live:
        if a.is_swapped(h):  # may still hold shared pages and pages a queued load fills
            swapped += pages_for(a.length(h), p)
            continue
        pg = a.pages(h).tolist()
        assert len(pg) == pages_for(a.length(h), p)
        assert 0 not in pg
        held.update(pg)
    # A queued copy holds its source page as one more holder, so a page may be
    # used without any request listing it; never the other way round.
    assert len(held) <= a.used_pages <= len(held) + a.pending_copies + swapped
    # free + held + pinned-but-unheld = the pool minus page 0.
    assert a.used_pages + a.free_pages <= a.capacity_pages
    if a.pinned_pages == 0:
        assert a.used_pages + a.free_pages == a.capacity_pages


def preview(a: SlotAllocator, prompt: list[int], salt: int) -> int:
    """The hit open_with_prefix would give, from read-only calls."""
    p = a.page_size
    full = len(prompt) // p
    if full == 0:
        return 0
    hashes = page_hashes(prompt, p, a.hash_seed, salt)
    m = int(a.match_chain_hashes(hashes, prompt[: full * p], salt))
    return min(m, (len(prompt) - 1) // p) * p


def refused_unchanged(a: SlotAllocator, live: list[int], before: tuple, call) -> None:
    a.take_events()
    with pytest.raises(PoolExhaustedError):
        call()
    assert snapshot(a, live) == before
    assert len(a.take_events()["kind"]) == 0
    a.check()


class Run:
    """One random sequence: the pool, its open requests and the tokens each knows."""

    def __init__(self, data, page_size: int, num_pages: int, kv_events: bool, host_pages: int = 0) -> None:
        self.d = data
        self.a = SlotAllocator(num_pages, page_size, 6, 24, hash_seed=7, kv_events=kv_events, manual_clock=True,
                               host_pages=host_pages)
        self.p = page_size
        self.live: list[int] = []
        self.prompts: dict[int, list[int]] = {}  # open_with_prefix prompts: extend must agree
        self.bases = [self.draw(st.lists(st.integers(0, 1), min_size=4, max_size=12)) for _ in range(2)]

    def draw(self, strategy):
        return self.d.draw(strategy)

    def prompt(self, n: int | None = None) -> list[int]:
        # A few base prompts and a 2-token alphabet: prompts share prefixes, so
        # hits, duplicates and continued registered pages happen.
        base = self.draw(st.sampled_from(self.bases))
        if n is None:
            n = self.draw(st.integers(1, len(base) + 2))
        tail = self.draw(st.lists(st.integers(0, 1), min_size=max(0, n - len(base)), max_size=max(0, n - len(base))))
        return (base + tail)[:n]

    def some_live(self) -> list[int]:
        resident = [h for h in self.live if not self.a.is_swapped(h)]
        return self.draw(st.lists(st.sampled_from(resident), min_size=1, max_size=3, unique=True)) if resident else []

    def swap(self) -> None:
        a = self.a
        if not a.host_pages or not self.live:
            return
        out = [h for h in self.live if a.is_swapped(h)]
        h = self.draw(st.sampled_from(out if out and self.draw(st.booleans()) else self.live))
        if not a.is_swapped(h):
            with contextlib.suppress(PoolExhaustedError):  # too few host pages: nothing moved
                a.swap_out([h])
            return
        # It needs a device page per host page it holds: at most one per page of its length.
        before = snapshot(a, self.live)
        need = pages_for(a.length(h), self.p)
        try:
            a.swap_in([h])
        except PoolExhaustedError:
            assert need > before[0][0], (need, before[0][0])
            assert snapshot(a, self.live) == before

    def extend_need(self, hs: list[int], counts: list[int]) -> tuple[int, int]:
        """(fewest, most) pages the extend can take: most adds one copy for each
        request that writes into a partly filled last page (shared, queued as a
        copy's source, or a registered page that cached pages continue)."""
        lo = hi = 0
        for h, c in zip(hs, counts):
            n = self.a.length(h)
            grow = pages_for(n + c, self.p) - pages_for(n, self.p)
            lo += grow
            hi += grow + (1 if c > 0 and n % self.p else 0)
        return lo, hi

    def admit(self) -> None:
        a = self.a
        counts = self.draw(st.lists(st.integers(0, 9), min_size=1, max_size=3))
        tokens = [t for c in counts for t in self.prompt(c)]
        if a.open_requests + len(counts) > a.max_requests:
            with pytest.raises(TooManyRequestsError):
                a.admit(counts, tokens=tokens)
            return
        need = sum(pages_for(c, self.p) for c in counts)
        before = snapshot(a, self.live)
        if need > a.free_pages:
            refused_unchanged(a, self.live, before, lambda: a.admit(counts, tokens=tokens))
            return
        free = a.free_pages
        hs, slots = a.admit(counts, tokens=tokens)
        assert len(slots) == sum(counts)
        assert a.free_pages == free - need  # fresh requests share nothing: no copy
        self.live += [int(h) for h in hs]

    def open_prefix(self) -> None:
        a = self.a
        if a.open_requests == a.max_requests:
            return
        prompt = self.prompt()
        salt = self.draw(st.sampled_from([0, 0, 3]))
        expect = preview(a, prompt, salt)  # device copies only: a host hit adds to it
        free, held = a.free_pages, {pg for h in self.live if not a.is_swapped(h) for pg in a.pages(h).tolist()}
        hs, cached = a.open_with_prefix(prompt, [len(prompt)], salt)
        h = int(hs[0])
        self.live.append(h)
        self.prompts[h] = prompt
        if a.host_pages:
            assert int(cached[0]) >= expect, (prompt, salt)
            if int(cached[0]) > expect:
                event("host hit")
        else:
            assert int(cached[0]) == expect, (prompt, salt)
        if expect:
            event("prefix hit")
        hit = a.pages(h).tolist()
        # Hit pages nobody held were evictable (or pinned): they stop being free.
        taken = len([pg for pg in hit if pg not in held])
        assert free - taken <= a.free_pages <= free
        # The rest of the prompt: at most pages_for(len) - hit pages, never a copy
        # (a hit ends on a page boundary).
        rest = len(prompt) - int(cached[0])
        need = pages_for(len(prompt), self.p) - len(hit)
        before = snapshot(a, self.live)
        if need > a.free_pages:
            refused_unchanged(a, self.live, before, lambda: a.extend([h], [rest], tokens=prompt[-rest:]))
        else:
            a.extend([h], [rest], tokens=prompt[-rest:])

    def extend(self) -> None:
        a = self.a
        if not (hs := self.some_live()):
            return
        counts = [self.draw(st.integers(0, 6)) for _ in hs]
        counts = [min(c, a.max_context_len - a.length(h)) for h, c in zip(hs, counts)]
        known = [len(a.known_tokens(h)) == a.length(h) for h in hs]
        tokens = None
        if all(known) and self.draw(st.booleans()):
            tokens = []
            for h, c in zip(hs, counts):
                ahead = self.prompts.get(h, [])[a.length(h):]
                mine = self.draw(st.lists(st.integers(0, 1), min_size=c, max_size=c))
                tokens += ahead[:c] + mine[len(ahead[:c]):]
        lo, hi = self.extend_need(hs, counts)
        # Every form of extend counts pages the same way; table= and out= stay as they were on a refusal.
        form = self.draw(st.sampled_from(["plain", "table", "out", "packed", "starts"]))
        table, out = padded_table(a.max_requests, a.max_context_len), np.full(sum(counts) + 2, -7, np.int64)
        table[:] = -5
        calls = {
            "plain": lambda: a.extend(hs, counts, tokens=tokens),
            "table": lambda: a.extend(hs, counts, table=table, tokens=tokens),
            "out": lambda: a.extend(hs, counts, tokens=tokens, out=out),
            "packed": lambda: a.extend_packed(hs, counts, tokens),
            "starts": lambda: a.extend_with_starts(hs, counts),
        }
        before = snapshot(a, self.live)
        free = a.free_pages
        if lo > free:
            refused_unchanged(a, self.live, before, calls[form])
            assert (table == -5).all() and (out == -7).all()
            return
        try:
            calls[form]()
        except PoolExhaustedError:
            # Only a batch whose copies the queries could not rule out may be refused.
            assert hi > free, (lo, hi, free)
            event("extend refused for a copy")
            assert snapshot(a, self.live) == before
            assert (table == -5).all() and (out == -7).all()
            return
        # Pages taken: at least the growth, at most growth plus one copy each.
        assert free - hi <= a.free_pages <= free - lo
        if a.free_pages < free - lo:
            event("extend took a copy page")

    def truncate(self) -> None:
        if hs := self.some_live():
            n, was = self.draw(st.integers(0, self.a.length(hs[0]))), self.a.length(hs[0])
            self.a.truncate(hs[:1], [n])
            if n < was and hs[0] in self.prompts:  # a shortened request forgets its prompt from there
                self.prompts[hs[0]] = self.prompts[hs[0]][:n]

    def fork(self) -> None:
        a, hs = self.a, self.some_live()
        if not hs or a.open_requests == a.max_requests:
            return
        free = a.free_pages
        parent = hs[0]
        kids = a.fork(parent, 1)
        self.live += [int(k) for k in kids]
        for k in kids:
            self.prompts[int(k)] = list(self.prompts.get(parent, []))
        assert a.free_pages == free  # a fork takes no page

    def cache(self) -> None:
        if hs := self.some_live():
            self.a.cache(hs, priority=self.draw(st.sampled_from([None, None, 100, 10])))

    def close(self) -> None:
        if not self.live:
            return
        h = self.draw(st.sampled_from(self.live))
        self.a.close([h], cache=self.draw(st.booleans()) and not self.a.is_swapped(h))
        self.live.remove(h)

    def evict(self) -> None:
        a, n = self.a, self.draw(st.integers(0, 3))
        free, ev, by = a.free_pages, a.evictable_pages, a.evictable_pages_by_priority()
        assert a.evict(n) == min(n, ev)
        gone = by - a.evictable_pages_by_priority()  # lowest priority first: whole bins, then part of one
        k = int(np.argmax(gone != by)) if (gone != by).any() else len(by)
        assert (gone[:k] == by[:k]).all() and gone[k + 1 :].sum() == 0
        assert a.free_pages == free and a.evictable_pages == ev - min(n, ev)

    def take_copies(self) -> None:  # before a step's writes: offloads, loads, then copies
        self.a.take_offloads(), self.a.take_loads(), self.a.take_copies()

    def unpin(self) -> None:
        if hs := self.some_live():
            self.a.unpin(hs)

    STEPS = ("admit", "admit", "open_prefix", "open_prefix", "extend", "extend", "truncate", "fork", "cache",
             "cache", "close", "close", "evict", "take_copies", "unpin", "swap")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(3, 16), kv_events=st.booleans(),
       host_pages=st.sampled_from([0, 0, 3, 8]))
def test_scheduler_queries_predict_what_the_pool_does(data, page_size, num_pages, kv_events, host_pages) -> None:
    run = Run(data, page_size, num_pages, kv_events, host_pages)
    for _ in range(30):
        getattr(run, data.draw(st.sampled_from(Run.STEPS)))()
        consistent(run.a, run.live)


# ----- GroupedAllocator: admissible_tokens / admissible_requests ---------------


def grouped_snapshot(g, live: list[int]) -> tuple:
    per_group = tuple((g.free_pages(i), g.used_pages(i), g.cached_pages(i), g.evictable_pages(i),
                       g.admissible_tokens(i)) for i in range(g.num_groups))
    reqs = tuple((h, g.length(h), tuple(g.known_tokens(h).tolist())) for h in live)
    return per_group, g.open_requests, g.admissible_tokens(), g.admissible_requests, reqs


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    full_page=st.sampled_from([1, 2, 4]),
    full_pages=st.integers(3, 12),
    sliding=st.none() | st.tuples(st.sampled_from([1, 2, 3]), st.integers(3, 12), st.integers(1, 6)),
    state=st.none() | st.integers(2, 5),
)
def test_grouped_admissible_counts_predict_admit(data, full_page, full_pages, sliding, state) -> None:
    """GroupedAllocator.admissible_tokens: "a request of n new tokens fits if
    n <= admissible_tokens()" (with admissible_requests >= 1); a refusal changes nothing."""
    groups = [{"kind": "full", "num_pages": full_pages, "page_size": full_page}]
    if sliding is not None:
        groups.append({"kind": "sliding", "num_pages": sliding[1], "page_size": sliding[0], "window": sliding[2]})
    if state is not None:
        groups.append({"kind": "state", "num_slots": state, "checkpoint_every": 0})
    g = GroupedAllocator(groups, max_requests=4, max_context_len=24, hash_seed=3)
    live: list[int] = []
    prompt = data.draw(st.lists(st.integers(0, 1), min_size=24, max_size=24))
    for _ in range(20):
        step = data.draw(st.sampled_from(["admit", "admit", "extend", "close", "cache"]))
        if step == "admit":
            fits = g.admissible_tokens()
            n = min(data.draw(st.integers(0, fits + 2)), 24)
            before = grouped_snapshot(g, live)
            try:
                hs, _ = g.admit([n], tokens=prompt[:n])
            except TooManyRequestsError:
                assert g.open_requests == g.max_requests
                continue
            except PoolExhaustedError:
                assert n > fits or g.admissible_requests == 0, (n, fits)
                assert grouped_snapshot(g, live) == before
                g.check()
                continue
            live += [int(h) for h in hs]
        elif live and step == "extend":
            h = data.draw(st.sampled_from(live))
            c = min(data.draw(st.integers(0, 6)), 24 - g.length(h))
            before = grouped_snapshot(g, live)
            try:
                g.extend([h], [c], tokens=prompt[g.length(h) : g.length(h) + c])
            except PoolExhaustedError:
                assert grouped_snapshot(g, live) == before
        elif live and step == "close":
            h = data.draw(st.sampled_from(live))
            g.close([h], cache=data.draw(st.booleans()))
            live.remove(h)
        elif live:
            g.cache([data.draw(st.sampled_from(live))])
        g.check()
        assert g.open_requests == len(live)


# ----- admissible_tokens and the copy an extend may take -------------------------


def test_admissible_tokens_is_a_page_budget_not_a_batch_guarantee() -> None:
    """admissible_tokens = free_slots: one new request of that many tokens fits,
    one more token does not; but several new requests round up to pages each, and
    a request writing into a shared partly filled page copies it first."""
    a = SlotAllocator(4, 4, 6, 24, hash_seed=1)
    h = int(a.admit([2])[0][0])
    assert (a.free_pages, a.admissible_tokens) == (2, 8)
    before = snapshot(a, [h])
    refused_unchanged(a, [h], before, lambda: a.admit([9]))
    refused_unchanged(a, [h], before, lambda: a.admit([1, 1, 1]))  # 3 tokens, 3 pages
    kid = int(a.fork(h, 1)[0])
    before = snapshot(a, [h, kid])
    # 7 <= admissible_tokens, but the kid's last page (2 tokens, shared) is copied: 3 pages.
    refused_unchanged(a, [h, kid], before, lambda: a.extend([kid], [7]))
    a.extend([kid], [6])  # the copy and one page more
    assert a.free_pages == 0
    a.check()


def test_extend_after_truncating_into_a_registered_page_writes_in_place() -> None:
    """A request truncated into a registered page it alone holds writes on in place: its
    next extend inside that page takes no page and no copy (so it fits with no free page,
    as its length says), the page's registration goes, and the request keeps its slots."""
    p = 4
    a = SlotAllocator(5, p, 6, 24, hash_seed=1, max_pinned_pages=4)
    prompt = list(range(12))
    h = int(a.admit([12], tokens=prompt)[0][0])
    a.cache([h], priority=100)  # pinned: the continuation stays cached but is not free
    a.truncate([h], [6])  # into page 2 of 3, which page 3 (cached, pinned) continues
    assert a.free_pages == 1 and a.evictable_pages == 0
    filler = int(a.admit([4])[0][0])  # takes the last free page
    assert a.free_pages == 0
    cached, slots = a.cached_pages, a.slots(h).tolist()
    # Length 6 -> 7 stays in page 2: no new page by length, and none for a copy.
    new = a.extend([h], [1])
    assert new.tolist() == [slots[5] + 1] and a.slots(h).tolist() == slots + new.tolist()
    assert a.free_pages == 0 and a.pending_copies == 0 and a.cached_pages == cached - 1
    a.check()
    a.close([filler])
    a.check()


def test_kvpool_refusals_leave_the_tables_and_counters_as_they_were() -> None:
    """KVPool.admit / extend (CPU): the queries say the batch does not fit, the call is
    PoolExhaustedError, and req_to_token, every counter and every request are unchanged."""
    pool = kvpool.KVPool(2, 2, 8, dtype=torch.float32, page_size=4, num_pages=4, max_requests=6, max_context_len=24)
    h = int(pool.admit([2], tokens=[5, 6])[0][0])
    kid = int(pool.fork(h, 1)[0])
    live = [h, kid]
    table = pool.req_to_token.clone()
    before = snapshot(pool.allocator, live)
    assert pool.free_pages == 2
    for call in (lambda: pool.admit([4, 4, 1]), lambda: pool.extend([kid], [7]), lambda: pool.extend(live, [7, 1])):
        refused_unchanged(pool.allocator, live, before, call)
        assert torch.equal(pool.req_to_token, table)
    ext = pool.extend(live, [2, 2])  # one copy: the family's second writer owns the page
    assert len(ext.slots) == 4 and pool.free_pages == 1 and pool.allocator.pending_copies == 0
    pool.check()
