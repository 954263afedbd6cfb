"""Outside check of swap_in re-taking a page's registered device copy (f9b91aa): the room
check, what is re-taken and what is loaded, all-or-nothing refusals, and the bytes each
position reads back (a simulated store for SlotAllocator, torch tensors for KVPool on CPU)."""

import numpy as np
import pytest
import torch

import kvpool

PS = 2


class Store:
    """One int64 per slot on each tier, moved as the queues say: offloads, loads, copies."""

    def __init__(self, a):
        self.dev = np.zeros(a.num_pages * PS, np.int64)
        self.host = np.zeros(a.host_pages * PS, np.int64)

    def run(self, a):
        d, h = a.take_offloads()
        for dp, hp in zip(d, h):
            self.host[hp * PS:(hp + 1) * PS] = self.dev[dp * PS:(dp + 1) * PS]
        h2, d2 = a.take_loads()
        for hp, dp in zip(h2, d2):
            self.dev[dp * PS:(dp + 1) * PS] = self.host[hp * PS:(hp + 1) * PS]
        src, dst = a.take_copies()
        self.dev[dst] = self.dev[src]
        return len(d2)

    def compute(self, a, h, tokens, base):
        """A step over a fresh request: the transfers, then K/V base+i at position i."""
        a.extend(h, [len(tokens)], tokens=tokens)
        self.run(a)
        self.dev[a.slots(h[0])] = base + np.arange(len(tokens))
        return self.dev[a.slots(h[0])].copy()


def alloc(num_pages, **kw):
    return kvpool.SlotAllocator(num_pages, PS, 4, 32, hash_seed=1, host_pages=16, **kw)


def state(a):
    return (a.free_pages, a.cached_pages, a.host_free_pages, a.host_cached_pages, a.pending_loads,
            a.pending_offloads, a.loaded_pages, a.offloaded_pages)


def shared_prefix_swapped(num_pages, **kw):
    """A computes and publishes [1..4] (two full pages) plus one token and is swapped out;
    B hits those two pages, adds one and is swapped out: both hold the same two host copies, whose
    device copies stay CACHED. C holds `num_pages - 5` pages, so 2 device pages are FREE."""
    a = alloc(num_pages, **kw)
    st = Store(a)
    A = a.open(1)
    want_a = st.compute(a, A, [1, 2, 3, 4, 5], 100)
    a.cache(A)
    a.swap_out(A)
    st.run(a)
    B, hit = a.open_with_prefix([1, 2, 3, 4, 6], [5])
    assert int(hit[0]) == 4
    a.extend(B, [1], tokens=[6])
    st.run(a)
    st.dev[a.slots(B[0])[4]] = 900
    want_b = np.r_[want_a[:4], 900]
    a.swap_out(B)  # reuses the host copies A holds
    st.run(a)
    C = a.open(1)
    a.extend(C, [2 * (num_pages - 5)], tokens=list(range(50, 50 + 2 * (num_pages - 5))))
    return a, st, A, B, C, want_a, want_b


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_a_copy_both_requests_hold_is_counted_once(policy):
    """Two requests that hit the same pages before swap_out hold the same host copies and
    re-take the same device copies: the room check counted each copy once per request and
    refused a swap_in that fits (2 re-taken + 2 loads need 4 pages, counted as 6)."""
    a, st, A, B, C, want_a, want_b = shared_prefix_swapped(9, host_policy=policy)
    assert (a.free_pages, a.cached_pages) == (4, 2)  # free_pages: 2 FREE + the 2 CACHED copies, just the room needed
    a.check()
    a.swap_in([A[0], B[0]])
    a.check()
    assert st.run(a) == 2  # the two tail pages; the shared prefix is re-taken
    assert list(a.pages(A[0])[:2]) == list(a.pages(B[0])[:2])
    assert (st.dev[a.slots(A[0])] == want_a).all() and (st.dev[a.slots(B[0])] == want_b).all()


def test_swap_in_is_refused_exactly_when_there_is_no_room_and_changes_nothing():
    """With one page fewer than the loads need, swap_in is refused and leaves every counter
    and the event log as they were; with exactly enough, it succeeds."""
    a, st, A, B, C, _, _ = shared_prefix_swapped(9)
    a.extend(C, [2], tokens=[70, 71])  # one FREE page left: the loads need two
    a.take_events()
    before = state(a)
    with pytest.raises(kvpool.PoolExhaustedError):
        a.swap_in([A[0], B[0]])
    assert state(a) == before and a.is_swapped(A[0]) and a.is_swapped(B[0])
    assert len(a.take_events()["kind"]) == 0
    a.check()
    a.truncate(C, [a.length(C[0]) - 2])
    a.swap_in([A[0], B[0]])
    a.check()


def test_a_pinned_copy_is_re_taken_without_room():
    """A pinned CACHED copy is not in the room swap_in counts, and re-taking it needs none:
    with no FREE or evictable page, a request whose pages all have a pinned device copy
    comes back with no load."""
    a = alloc(6, max_pinned_pages=2)
    st = Store(a)
    A = a.open(1)
    want = st.compute(a, A, [1, 2, 3, 4], 10)
    a.cache(A, priority=100)
    a.swap_out(A)
    st.run(a)
    assert a.pinned_pages == 2
    C = a.open(1)
    a.extend(C, [2 * 3], tokens=list(range(50, 56)))
    assert a.free_pages == 0
    a.swap_in(A)
    a.check()
    assert st.run(a) == 0 and (st.dev[a.slots(A[0])] == want).all()
    assert a.pinned_pages == 2


@pytest.mark.parametrize("close_b", [False, True])
def test_a_copy_with_its_load_still_queued_is_re_taken(close_b):
    """A's host copy is the entry's only copy; B's host hit loads it into a device page, and
    before the load is taken A comes back: it re-takes that page (no second load), and after
    the one load both read A's bytes. Also when B closed before the load ran."""
    a = alloc(8)
    st = Store(a)
    A = a.open(1)
    want = st.compute(a, A, [1, 2, 3, 4, 5], 10)
    a.cache(A)
    a.swap_out(A)
    st.run(a)
    assert a.evict(8) == 2  # the device copies go; the entry lives on the host
    B, hit = a.open_with_prefix([1, 2, 3, 4, 9], [5])
    assert int(hit[0]) == 4 and a.pending_loads == 2
    loaded = list(a.pages(B[0])[:2])
    if close_b:
        a.close(B)
    a.swap_in(A)
    a.check()
    assert list(a.pages(A[0])[:2]) == loaded
    assert a.pending_loads == 3  # B's two, A's unregistered tail page
    st.run(a)
    assert (st.dev[a.slots(A[0])] == want).all()
    # Out again at once and back: the same bytes.
    a.swap_out(A)
    st.run(a)
    a.swap_in(A)
    st.run(a)
    a.check()
    assert (st.dev[a.slots(A[0])] == want).all()


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_kvpool_retake_is_bitwise_and_events_match(policy):
    """KVPool on CPU: A's published prefix is hit by B (HELD) and its tail page is CACHED;
    A comes back with loads only for what has no device copy, reads every position
    bitwise, and the events' device view is the registered pages."""
    p = kvpool.KVPool(2, 1, 4, dtype=torch.float32, page_size=PS, num_pages=10, max_requests=4,
                      max_context_len=32, host_pages=16, host_policy=policy, hash_seed=3)
    stored = set()

    def feed():
        ev = p.take_events()
        for kind, medium, page in zip(ev["kind"], ev["medium"], ev["page"]):
            if int(medium) == 0:
                (stored.add if int(kind) == 0 else stored.discard)(int(page))

    def kv(n, base):
        x = torch.arange(n, dtype=torch.float32).view(n, 1, 1) + base
        return x.expand(n, 1, 4).contiguous()

    A, _ = p.open_with_prefix([1, 2, 3, 4, 5, 6, 7], [7])
    res = p.extend(A, [7])
    for layer in range(2):
        p.write(layer, res.slots, kv(7, 10 * layer), -kv(7, 10 * layer))
    want = [p.read(layer, p.slots(A[0])) for layer in range(2)]
    p.cache(A)
    B, hit = p.open_with_prefix([1, 2, 3, 4, 8], [5])
    assert int(hit[0]) == 4
    p.swap_out(A)
    loaded = p.stats().loaded_pages
    p.swap_in(A)
    assert p.stats().loaded_pages - loaded == 1  # the unregistered tail page only
    for layer in range(2):
        k, v = p.read(layer, p.slots(A[0]))
        assert torch.equal(k, want[layer][0]) and torch.equal(v, want[layer][1])
    p.check()
    feed()
    reg = {int(q) for q in p.allocator.pages(A[0])[:3]}
    assert reg <= stored


@pytest.mark.parametrize("evict", [False, True])
def test_duplicate_registration_between_swap_out_and_swap_in(evict):
    """A registered page comes back as its entry's copy (the contract): where B's recomputation
    of the same tokens replaced that copy meanwhile (taking over the unheld device copy, or
    attaching to the host-only entry after an eviction), A reads B's K/V for those tokens, as
    a prefix hit would; its unregistered last page comes back bitwise its own."""
    a = alloc(8)
    st = Store(a)
    A = a.open(1)
    want = st.compute(a, A, [1, 2, 3], 10)
    a.cache(A)
    a.swap_out(A)
    st.run(a)
    if evict:
        a.evict(1)
    B = a.open(1)
    dup = st.compute(a, B, [1, 2, 3], 20)  # the same tokens, recomputed (other bytes)
    a.cache(B)
    st.run(a)
    a.swap_in(A)
    st.run(a)
    a.check()
    assert st.dev[a.slots(A[0])].tolist() == [*dup[:PS], *want[PS:]]


@pytest.mark.parametrize("who", ["self", "other"])
def test_a_re_taken_copy_truncated_into_is_not_written_in_place(who):
    """A truncated into its own registered page ("self"), or B hit A's pages and truncated
    into the one A comes back to ("other", before B's next write): the re-taken page is then
    written by a request that does not hold it alone or that must unregister it first. Every
    reader keeps its bytes, and a later prompt hits the published K/V."""
    a = alloc(10)
    st = Store(a)
    A = a.open(1)
    want = st.compute(a, A, [1, 2, 3, 4, 5], 10)
    a.cache(A)
    w = A
    if who == "self":
        a.truncate(A, [3])
        want = want[:3]
    else:
        w, hit = a.open_with_prefix([1, 2, 3, 4, 9], [5])
        assert int(hit[0]) == 4
        a.truncate(w, [3])
    a.swap_out(A)
    st.run(a)
    a.swap_in(A)
    st.run(a)
    assert (st.dev[a.slots(A[0])] == want).all()
    a.extend(w, [1], tokens=[7])  # position 3 of a page the index holds: copy or unregister
    st.run(a)
    st.dev[a.slots(w[0])[3]] = 777
    a.check()
    if who == "self":
        want = np.r_[want, 777]
    assert (st.dev[a.slots(A[0])] == want).all()
    R, hit = a.open_with_prefix([1, 2, 3, 4, 5], [5])
    st.run(a)
    assert int(hit[0]) >= 2 and (st.dev[a.slots(R[0])[:int(hit[0])]] == 10 + np.arange(int(hit[0]))).all()
