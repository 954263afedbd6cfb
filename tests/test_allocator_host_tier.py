"""SlotAllocator's host tier through the bindings: what the torch-side wiring
drives (take_offloads / take_loads, swap_out / swap_in, the counters, events with
their medium), on a simulated K/V store where each page holds a numpy row: the
bytes a request reads back after offload -> evict -> load and after swap_out ->
swap_in must be bitwise what it wrote."""

from __future__ import annotations

import numpy as np
import pytest

import kvpool
from kvpool import SlotAllocator, _core

PS = 4


class Store:
    """Device and host pages of random bytes (uint8 rows), moved as the queues say,
    in the documented order: offloads, loads, copies."""

    def __init__(self, a: SlotAllocator, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.dev = rng.integers(0, 256, (a.num_pages * PS, 8), dtype=np.uint8)
        self.host = rng.integers(0, 256, (a.host_pages * PS, 8), dtype=np.uint8)

    def run(self, a: SlotAllocator) -> tuple[int, int]:
        d, h = a.take_offloads()
        assert d.dtype == np.int64 and h.dtype == np.int64
        for dp, hp in zip(d, h):
            self.host[hp * PS : (hp + 1) * PS] = self.dev[dp * PS : (dp + 1) * PS]
        h2, d2 = a.take_loads()
        for hp, dp in zip(h2, d2):
            self.dev[dp * PS : (dp + 1) * PS] = self.host[hp * PS : (hp + 1) * PS]
        src, dst = a.take_copies()
        self.dev[dst] = self.dev[src]
        return len(d), len(d2)

    def write(self, a: SlotAllocator, h: int, start: int, seed: int) -> None:
        """The step: the queued transfers, then new K/V at positions start.."""
        self.run(a)
        slots = a.slots(h)[start:]
        self.dev[slots] = np.random.default_rng(seed).integers(0, 256, (len(slots), 8), dtype=np.uint8)


def tiered(policy: str = "write_back", num_pages: int = 6, host_pages: int = 8) -> SlotAllocator:
    return SlotAllocator(num_pages, PS, 4, 32, hash_seed=5, host_pages=host_pages, host_policy=policy)


def test_no_tier_is_the_default_and_changes_nothing():
    a, b = SlotAllocator(16, PS, 4, 32, hash_seed=5), SlotAllocator(16, PS, 4, 32, hash_seed=5, host_pages=0)
    assert (a.host_pages, a.host_policy) == (0, None)
    assert a.metadata_bytes == b.metadata_bytes
    for x in (a.take_offloads(), a.take_loads()):
        assert [v.dtype for v in x] == [np.int64, np.int64] and all(len(v) == 0 for v in x)
    h, _ = a.open_with_prefix(list(range(9)), [9])
    a.extend(h, 9)
    a.close(h, cache=True)
    assert a.evict(1) == 1
    s = a.stats()
    assert (s.host_free_pages, s.host_cached_pages, s.host_hit_tokens, s.offloaded_pages, s.loaded_pages) == (0,) * 5
    assert a.pending_offloads == a.pending_loads == 0
    e = a.take_events()
    assert e["medium"].dtype == np.uint8 and not e["medium"].any()


def test_write_back_offloads_an_evicted_page_and_a_host_hit_loads_it_bitwise():
    a = tiered()
    st = Store(a)
    prompt = list(range(100, 109))  # two full pages and a token
    h, cached = a.open_with_prefix(prompt, [9])
    a.extend(h, 9)
    st.write(a, h[0], 0, seed=1)
    wrote = st.dev[a.slots(h[0])[:8]].copy()
    a.close(h, cache=True)
    assert a.evict(2) == 2
    assert (a.pending_offloads, a.host_cached_pages, a.cached_pages) == (2, 2, 0)
    st.run(a)
    # Other requests take and write every device page.
    fill, _ = a.open_with_prefix([7] * 20, [20])
    a.extend(fill, 20)
    st.write(a, fill[0], 0, seed=2)
    a.close(fill)
    h, cached = a.open_with_prefix(prompt, [9])
    assert cached.tolist() == [8] and a.pending_loads == 2
    assert (a.host_hit_tokens, a.hit_tokens) == (8, 8)
    assert st.run(a) == (0, 2)
    assert (st.dev[a.slots(h[0])] == wrote).all(), "a host hit reads bitwise what was written"
    assert (a.offloaded_pages, a.loaded_pages) == (2, 2)
    a.check()


def test_write_through_copies_at_cache_and_eviction_moves_nothing():
    a = tiered("write_through")
    st = Store(a)
    prompt = list(range(50, 59))
    h, _ = a.open_with_prefix(prompt, [9])
    a.extend(h, 9)
    st.write(a, h[0], 0, seed=3)
    wrote = st.dev[a.slots(h[0])[:8]].copy()
    a.cache(h)
    assert a.pending_offloads == 2, "cache() queues the host copies"
    st.run(a)
    a.close(h)
    assert a.evict(2) == 2 and a.pending_offloads == 0, "the entries keep their host copies"
    h, cached = a.open_with_prefix(prompt, [9])
    assert cached.tolist() == [8]
    st.run(a)
    assert (st.dev[a.slots(h[0])] == wrote).all()


def test_swap_out_swap_in_is_bitwise_and_the_request_keeps_its_handle():
    a = tiered(num_pages=5)
    st = Store(a)
    h = a.open(1)
    a.extend(h, 10)
    st.write(a, h[0], 0, seed=4)
    wrote = st.dev[a.slots(h[0])].copy()
    known_before = a.known_tokens(h[0])
    a.swap_out(h)
    assert a.is_swapped(h[0]) and a.pending_offloads == 3 and a.free_pages == 4
    assert (a.lengths(h).tolist(), a.rows(h).tolist()) == ([10], [int(h[0]) & 0xFFFFFFFF])
    assert (a.known_tokens(h[0]) == known_before).all()
    for call in (lambda: a.extend(h, 1), lambda: a.truncate(h, 1), lambda: a.fork(h[0]),
                 lambda: a.cache(h), lambda: a.slots(h[0]), lambda: a.pages(h[0]),
                 lambda: a.page_table(h)):
        with pytest.raises(kvpool.RequestSwappedOutError, match="swapped out"):
            call()
    st.run(a)
    # Another request takes and writes every device page, then leaves.
    other = a.open(1)
    a.extend(other, 16)
    st.write(a, other[0], 0, seed=5)
    a.close(other)
    a.swap_in(h)
    assert not a.is_swapped(h[0]) and a.pending_loads == 3
    st.run(a)
    assert (st.dev[a.slots(h[0])] == wrote).all(), "swap_out -> swap_in is bitwise"
    a.extend(h, 1)  # and it grows again
    a.check()


def test_request_swapped_out_error_is_a_kvpool_error_not_an_invalid_handle():
    err = kvpool.RequestSwappedOutError
    assert err is kvpool.errors.RequestSwappedOutError is _core.RequestSwappedOutError
    assert issubclass(err, kvpool.KVPoolError) and not issubclass(err, kvpool.InvalidHandleError)


def test_events_say_which_tier_and_encode_as_gpu_and_cpu():
    msgspec = pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
    a = tiered()
    h, _ = a.open_with_prefix(list(range(9)), [9])
    a.extend(h, 9)
    a.close(h, cache=True)
    a.evict(2)
    e = a.take_events()
    kinds = list(zip(e["kind"].tolist(), e["medium"].tolist()))
    # Stored on the device; then for each evicted page its host copy's Stored
    # and the device copy's Removed.
    assert kinds[:2] == [(0, 0), (0, 0)]
    assert sorted(kinds[2:]) == [(0, 1), (0, 1), (1, 0), (1, 0)]
    stored_host = [i for i, k in enumerate(kinds) if k == (0, 1)]
    assert all(e["page"][i] >= 1 for i in stored_host)  # host page ids
    payload = _core.encode_kv_events(e, 1.0)[0]
    events = msgspec.msgpack.decode(payload)[1]
    media = [(ev["type"], ev["medium"]) for ev in events]
    assert ("BlockStored", "GPU") in media and ("BlockStored", "CPU") in media and ("BlockRemoved", "GPU") in media
    # take_events_msgpack carries the medium too.
    b = tiered()
    h, _ = b.open_with_prefix(list(range(9)), [9])
    b.extend(h, 9)
    b.close(h, cache=True)
    b.evict(2)
    payload, stored, removed, cleared = b.take_events_msgpack(2.0)
    events = msgspec.msgpack.decode(payload)[1]
    assert (stored, removed, cleared) == (4, 2, 0)
    assert {(ev["type"], ev["medium"]) for ev in events} == {
        ("BlockStored", "GPU"), ("BlockStored", "CPU"), ("BlockRemoved", "GPU")}


def test_a_prompt_whose_device_pages_are_all_pinned_hits_them_on_a_full_pool():
    """With a host tier, a match reaching a host-only page counted holding any unheld device
    page as using up a page a load could take: on a pool whose every page was pinned (none
    free, none evictable) a prompt cached on the device up to a host page hit nothing, though
    match_chain_hashes said 4 tokens (found by tests/test_review_router_agreement.py's
    host-tier machine; this is its sequence)."""
    from kvpool._core import page_hashes

    a = kvpool.SlotAllocator(4, 2, 6, 14, hash_seed=7, max_pinned_pages=3, host_pages=2)

    def serve(tokens, priority=None):
        (h,), (c,) = a.open_with_prefix(tokens, [len(tokens)])
        a.extend([h], [len(tokens) - int(c)], tokens=tokens[int(c):])
        a.close([h], cache=True, **({} if priority is None else {"priority": priority}))

    serve([1, 1, 1, 1, 1, 3])  # pages [1, 1] [1, 1] [1, 3]
    for _ in range(3):
        a.evict(1)
    serve([1, 2])
    a.evict(1)  # [1, 3]'s only copy is on the host now
    serve([1, 1, 1, 1, 1, 1], priority=100)  # three device pages, all pinned
    assert (a.free_pages, a.pinned_pages) == (0, 3)
    longer = [1, 1, 1, 1, 1, 3, 1]
    words = page_hashes(np.asarray(longer, dtype=np.int64), 2, 7, 0)[:6]
    assert a.match_chain_hashes(words, longer[:6], 0) == 2  # (on the device)
    (h,), (cached,) = a.open_with_prefix(longer, [7])
    assert int(cached) == 4  # the two pinned pages; [1, 3]'s load finds no page: the match ends there
    a.close([h])
    a.check()
