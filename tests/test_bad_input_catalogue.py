"""The bad-input table: one parametrised case per input an engine could get wrong.

Every case asserts the exact exception class (a KVPoolError subclass, never
TypeError / OverflowError / MemoryError / a panic) and, for calls on a live
object, that its state is unchanged byte for byte: the allocator's counters,
every request's slots and pages, the CSR page table, ``metadata_bytes``, and
the raw bytes of every tensor the pool owns.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import kvpool
from kvpool import (
    ContextTooLongError,
    InvalidArgumentError,
    KVPoolError,
    PoolExhaustedError,
    RequestSwappedOutError,
    SlotAllocator,
    SlotRangeError,
    TooManyRequestsError,
)


def allocator_state(a: SlotAllocator, handles: np.ndarray) -> tuple:
    return (
        a.free_pages, a.used_pages, a.open_requests, a.metadata_bytes,
        a.lengths(handles).tobytes(),
        tuple(a.slots(h).tobytes() for h in handles),
        tuple(a.pages(h).tobytes() for h in handles),
        tuple(x.tobytes() for x in a.page_table(handles)),
    )


def pool_state(pool: kvpool.KVPool, handles: np.ndarray) -> tuple:
    raw = tuple((name, t.detach().contiguous().view(torch.uint8).clone().numpy().tobytes())
                for name, t in pool.named_tensors())
    return allocator_state(pool.allocator, handles) + raw


@pytest.fixture
def alloc() -> tuple[SlotAllocator, np.ndarray]:
    a = SlotAllocator(9, page_size=2, max_requests=4, max_context_len=8)
    h = a.open(3)
    a.extend(h, [3, 1, 4])
    return a, h


@pytest.fixture
def pool() -> tuple[kvpool.KVPool, np.ndarray]:
    p = kvpool.KVPool(2, 2, 4, dtype=torch.float16, num_pages=8, page_size=2, max_requests=3, max_context_len=8)
    h = p.open(2)
    res = p.extend(h, [3, 2])
    k = torch.randn(5, 2, 4).half()
    for layer in range(2):
        p.write(layer, res.slots, k, -k)
    return p, h


ALLOCATOR_CASES: list[tuple[str, type, Callable[[SlotAllocator, np.ndarray], Any]]] = [
    ("open(True)", InvalidArgumentError, lambda a, h: a.open(True)),
    ("open(1.5)", InvalidArgumentError, lambda a, h: a.open(1.5)),
    ("open(2**64)", InvalidArgumentError, lambda a, h: a.open(2**64)),
    ("open('1')", InvalidArgumentError, lambda a, h: a.open("1")),
    ("open(np.float32(1))", InvalidArgumentError, lambda a, h: a.open(np.float32(1))),
    ("open(-1)", InvalidArgumentError, lambda a, h: a.open(-1)),
    ("open(2**62)", TooManyRequestsError, lambda a, h: a.open(2**62)),
    ("open(2**33)", TooManyRequestsError, lambda a, h: a.open(2**33)),
    ("extend(h, True)", InvalidArgumentError, lambda a, h: a.extend(h, True)),
    ("extend(h, 2**34)", ContextTooLongError, lambda a, h: a.extend(h, 2**34)),
    ("extend(h, 2**64)", InvalidArgumentError, lambda a, h: a.extend(h, 2**64)),
    ("extend(h, [1, 2**63, 1])", InvalidArgumentError, lambda a, h: a.extend(h, [1, 2**63, 1])),
    ("extend(h, uint64 2**63)", InvalidArgumentError,
     lambda a, h: a.extend(h, np.array([1, 2**63, 1], dtype=np.uint64))),
    ("truncate(h, 1.5)", InvalidArgumentError, lambda a, h: a.truncate(h, 1.5)),
    ("close(True)", InvalidArgumentError, lambda a, h: a.close(True)),
    ("length('x')", InvalidArgumentError, lambda a, h: a.length("x")),
    ("swap_out(h) without a host tier", InvalidArgumentError, lambda a, h: a.swap_out(h)),
    ("swap_in(h) without a host tier", InvalidArgumentError, lambda a, h: a.swap_in(h)),
    ("swap_out(1.5)", InvalidArgumentError, lambda a, h: a.swap_out(1.5)),
    ("is_swapped('x')", InvalidArgumentError, lambda a, h: a.is_swapped("x")),
    ("take_events_msgpack('x')", InvalidArgumentError, lambda a, h: a.take_events_msgpack("x")),
    ("take_events_msgpack(True)", InvalidArgumentError, lambda a, h: a.take_events_msgpack(True)),
    ("take_events_msgpack(0.0, 2**70)", InvalidArgumentError, lambda a, h: a.take_events_msgpack(0.0, 2**70)),
    ("take_events_msgpack(0.0, 1.5)", InvalidArgumentError, lambda a, h: a.take_events_msgpack(0.0, 1.5)),
    ("encode_kv_events(ev, 'x')", InvalidArgumentError,
     lambda a, h: kvpool._core.encode_kv_events(a.take_events(), "x")),
    ("encode_kv_events(ev, 0.0, 2**70)", InvalidArgumentError,
     lambda a, h: kvpool._core.encode_kv_events(a.take_events(), 0.0, 2**70)),
    ("encode_kv_events([], 0.0)", InvalidArgumentError, lambda a, h: kvpool._core.encode_kv_events([], 0.0)),
    ("take_events_msgpack(nan)", InvalidArgumentError, lambda a, h: a.take_events_msgpack(float("nan"))),
    ("take_events_msgpack(inf)", InvalidArgumentError, lambda a, h: a.take_events_msgpack(float("inf"))),
    ("take_events_msgpack(0.0, -1)", InvalidArgumentError, lambda a, h: a.take_events_msgpack(0.0, -1)),
    ("encode_kv_events(ev, nan)", InvalidArgumentError,
     lambda a, h: kvpool._core.encode_kv_events(a.take_events(), float("nan"))),
    ("encode_kv_events(ev, 0.0, -1)", InvalidArgumentError,
     lambda a, h: kvpool._core.encode_kv_events(a.take_events(), 0.0, -1)),
]


@pytest.mark.parametrize("name,exc,call", ALLOCATOR_CASES, ids=[c[0] for c in ALLOCATOR_CASES])
def test_allocator_bad_input(alloc, name, exc, call):
    a, h = alloc
    before = allocator_state(a, h)
    with pytest.raises(KVPoolError) as info:
        call(a, h)
    assert type(info.value) is exc, f"{name}: {type(info.value).__name__}: {info.value}"
    assert allocator_state(a, h) == before
    a.check()


def test_a_bad_take_events_msgpack_argument_drains_nothing():
    a = SlotAllocator(9, page_size=2, max_requests=4, max_context_len=8)
    h, _ = a.open_with_prefix([1, 2, 3, 4], [4])
    a.extend(h, 4)
    a.cache(h)
    for bad in [("x",), (0.0, 2**70), (float("nan"),), (0.0, -1)]:
        with pytest.raises(InvalidArgumentError):
            a.take_events_msgpack(*bad)
    assert a.take_events_msgpack(1.0)[1:] == (2, 0, 0)


def test_huge_count_in_a_huge_page_pool_is_context_too_long():
    """A count past max_context_len is refused before its result array is sized
    (sizing it first would be a MemoryError when the page size makes num_slots
    huge). The core
    keeps per-slot metadata, so a pool of 2**41 slots is itself refused, typed."""
    with pytest.raises(InvalidArgumentError, match="cannot allocate"):
        SlotAllocator(2, page_size=2**40, max_requests=2, max_context_len=16)
    a = SlotAllocator(2, page_size=2**16, max_requests=2, max_context_len=16)
    h = a.open(1)
    before = allocator_state(a, h)
    with pytest.raises(ContextTooLongError, match="max_context_len=16"):
        a.extend(h, 2**34)
    with pytest.raises(ContextTooLongError):
        a.extend_with_starts(h, [2**34])
    assert allocator_state(a, h) == before


def test_a_count_past_max_context_len_sizes_no_result_array():
    """The same guard where the count fits the pool: a count past max_context_len, but not
    past num_slots, is refused before a result array of that many slots is allocated
    (tracemalloc sees numpy's allocations: the control extend shows it does)."""
    import tracemalloc

    count = 2**19  # 4 MiB of int64 slots
    a = SlotAllocator(2, page_size=2**20, max_requests=2, max_context_len=16)
    room = SlotAllocator(2, page_size=2**20, max_requests=2, max_context_len=2**20)
    h, hr = a.open(1), room.open(1)
    tracemalloc.start()
    try:
        room.extend(hr, count)  # (the control: a result of `count` slots is seen)
        assert tracemalloc.get_traced_memory()[1] >= 8 * count
        for call in (lambda: a.extend(h, count), lambda: a.extend_with_starts(h, [count])):
            tracemalloc.reset_peak()
            with pytest.raises(ContextTooLongError, match="max_context_len=16"):
                call()
            assert tracemalloc.get_traced_memory()[1] < 8 * count // 16
    finally:
        tracemalloc.stop()


def tier_state(a: SlotAllocator, resident: np.ndarray, swapped: np.ndarray) -> tuple:
    """allocator_state, plus the host tier's counters and queues, and what a
    swapped-out request still answers (its slots and pages are refused)."""
    return allocator_state(a, resident) + (
        a.lengths(swapped).tobytes(), tuple(a.known_tokens(h).tobytes() for h in swapped),
        tuple(bool(a.is_swapped(h)) for h in swapped),
        a.host_free_pages, a.host_cached_pages, a.pending_offloads, a.pending_loads, a.pending_copies,
    )


@pytest.fixture
def tiered() -> tuple[SlotAllocator, np.ndarray, np.ndarray]:
    """Two requests on the device, one swapped out; the host has 1 page left."""
    a = SlotAllocator(9, page_size=2, max_requests=4, max_context_len=8, host_pages=4)
    h = a.open(3)
    a.extend(h, [3, 1, 4])
    a.swap_out(h[2:])  # its two pages go to the host
    a.take_offloads()
    return a, h[:2], h[2:]


TIER_CASES: list[tuple[str, type, Callable[[SlotAllocator, np.ndarray, np.ndarray], Any]]] = [
    ("extend(swapped)", RequestSwappedOutError, lambda a, r, s: a.extend([r[0], s[0]], 1)),
    ("truncate(swapped)", RequestSwappedOutError, lambda a, r, s: a.truncate(s, 0)),
    ("fork(swapped)", RequestSwappedOutError, lambda a, r, s: a.fork(s[0], 1)),
    ("cache(swapped)", RequestSwappedOutError, lambda a, r, s: a.cache(s)),
    ("close(swapped, cache=True)", RequestSwappedOutError, lambda a, r, s: a.close(s, cache=True)),
    ("cache(swapped, priority=)", RequestSwappedOutError, lambda a, r, s: a.cache(s, priority=50)),
    ("close(swapped, cache=True, priority=)", RequestSwappedOutError,
     lambda a, r, s: a.close(s, cache=True, priority=100)),
    ("unpin(swapped)", RequestSwappedOutError, lambda a, r, s: a.unpin([r[0], s[0]])),
    ("slots(swapped)", RequestSwappedOutError, lambda a, r, s: a.slots(s[0])),
    ("pages(swapped)", RequestSwappedOutError, lambda a, r, s: a.pages(s[0])),
    ("page_table(swapped)", RequestSwappedOutError, lambda a, r, s: a.page_table(s)),
    ("swap_out(swapped)", RequestSwappedOutError, lambda a, r, s: a.swap_out([r[0], s[0]])),
    ("swap_out more than the host holds", PoolExhaustedError, lambda a, r, s: a.swap_out(r)),
    ("swap_out([h, h])", InvalidArgumentError, lambda a, r, s: a.swap_out([r[0], r[0]])),
    ("swap_in(resident)", InvalidArgumentError, lambda a, r, s: a.swap_in([s[0], r[0]])),
    ("swap_in([h, h])", InvalidArgumentError, lambda a, r, s: a.swap_in([s[0], s[0]])),
    ("swap_in(closed handle)", kvpool.InvalidHandleError, lambda a, r, s: a.swap_in([s[0], 12345])),
]


@pytest.mark.parametrize("name,exc,call", TIER_CASES, ids=[c[0] for c in TIER_CASES])
def test_host_tier_bad_input(tiered, name, exc, call):
    a, resident, swapped = tiered
    before = tier_state(a, resident, swapped)
    with pytest.raises(KVPoolError) as info:
        call(a, resident, swapped)
    assert type(info.value) is exc, f"{name}: {type(info.value).__name__}: {info.value}"
    assert tier_state(a, resident, swapped) == before
    a.check()


def test_swap_in_without_device_room_is_pool_exhausted_and_changes_nothing(tiered):
    a, resident, swapped = tiered
    a.extend(resident, [8 - 3, 8 - 1])  # every device page held: none for the two host pages
    before = tier_state(a, resident, swapped)
    with pytest.raises(PoolExhaustedError, match="needs 2 free pages"):
        a.swap_in(swapped)
    assert tier_state(a, resident, swapped) == before
    a.check()
@pytest.fixture
def prompted() -> tuple[SlotAllocator, np.ndarray]:
    """Requests whose token ids are known, so cache() with a priority would
    register and prioritise pages; one full page already cached and pinned."""
    a = SlotAllocator(9, page_size=2, max_requests=4, max_context_len=8, manual_clock=True)
    h, _ = a.open_with_prefix(list(range(9)), [3, 2, 4])
    a.extend(h, [3, 2, 4])
    a.cache(h[:1], priority=100)
    a.set_clock(1.0)
    a.take_events()  # so that any event a refused call records shows
    return a, h


def priority_state(a: SlotAllocator, h: np.ndarray) -> tuple:
    return allocator_state(a, h) + (
        a.cached_pages, a.evictable_pages, a.pinned_pages, a.clock,
        a.evictable_pages_by_priority().tobytes(), a.take_events()["kind"].tobytes(),
    )


PRIORITY_CASES: list[tuple[str, Callable[[SlotAllocator, np.ndarray], Any]]] = [
    ("cache(priority=101)", lambda a, h: a.cache(h, priority=101)),
    ("cache(priority=-1)", lambda a, h: a.cache(h, priority=-1)),
    ("cache(priority=True)", lambda a, h: a.cache(h, priority=True)),
    ("cache(priority=1.5)", lambda a, h: a.cache(h, priority=1.5)),
    ("cache(priority='5')", lambda a, h: a.cache(h, priority="5")),
    ("cache(priority=[1, 2]) for 3", lambda a, h: a.cache(h, priority=[1, 2])),
    ("cache(priority=[1, 2, 101])", lambda a, h: a.cache(h, priority=[1, 2, 101])),
    ("cache(retain_s=1) alone", lambda a, h: a.cache(h, retain_s=1)),
    ("cache(retain_s=0)", lambda a, h: a.cache(h, priority=5, retain_s=0)),
    ("cache(retain_s=-1)", lambda a, h: a.cache(h, priority=5, retain_s=-1)),
    ("cache(retain_s=nan)", lambda a, h: a.cache(h, priority=5, retain_s=float("nan"))),
    ("cache(retain_s=inf)", lambda a, h: a.cache(h, priority=5, retain_s=float("inf"))),
    ("cache(retain_s=2e9)", lambda a, h: a.cache(h, priority=5, retain_s=2e9)),
    ("cache(retain_s=True)", lambda a, h: a.cache(h, priority=5, retain_s=True)),
    ("cache(retain_s='1')", lambda a, h: a.cache(h, priority=5, retain_s="1")),
    ("cache(retain_s=np.True_)", lambda a, h: a.cache(h, priority=5, retain_s=np.True_)),
    ("cache(retain_s=np.array(True))", lambda a, h: a.cache(h, priority=5, retain_s=np.array(True))),
    ("cache(retain_s=torch.tensor(True))", lambda a, h: a.cache(h, priority=5, retain_s=torch.tensor(True))),
    ("cache(priority=) twice a handle", lambda a, h: a.cache([h[0], h[0]], priority=5)),
    ("close(priority=) without cache", lambda a, h: a.close(h, priority=5)),
    ("close(cache=True, priority=200)", lambda a, h: a.close(h, cache=True, priority=200)),
    ("close(cache=True, retain_s=1) alone", lambda a, h: a.close(h, cache=True, retain_s=1)),
    ("unpin(True)", lambda a, h: a.unpin(True)),
    ("unpin twice a handle", lambda a, h: a.unpin([h[0], h[0]])),
    ("set_clock(0.5) back", lambda a, h: a.set_clock(0.5)),
    ("set_clock(-1)", lambda a, h: a.set_clock(-1)),
    ("set_clock(nan)", lambda a, h: a.set_clock(float("nan"))),
    ("set_clock('2')", lambda a, h: a.set_clock("2")),
    ("set_clock(np.True_)", lambda a, h: a.set_clock(np.True_)),
    ("set_clock(torch.tensor(True))", lambda a, h: a.set_clock(torch.tensor(True))),
]


@pytest.mark.parametrize("name,call", PRIORITY_CASES, ids=[c[0] for c in PRIORITY_CASES])
def test_priority_bad_input(prompted, name, call):
    a, h = prompted
    before = priority_state(a, h)
    with pytest.raises(KVPoolError) as info:
        call(a, h)
    assert type(info.value) is InvalidArgumentError, f"{name}: {type(info.value).__name__}: {info.value}"
    assert priority_state(a, h) == before
    a.check()


def test_a_system_clock_cannot_be_set(alloc):
    a, h = alloc
    with pytest.raises(InvalidArgumentError, match="manual_clock=True"):
        a.set_clock(1.0)


CONSTRUCTOR_CASES: list[tuple[str, Callable[[], Any]]] = [
    ("SlotAllocator('4')", lambda: SlotAllocator("4")),
    ("SlotAllocator(4.0)", lambda: SlotAllocator(4.0)),
    ("SlotAllocator(4, True)", lambda: SlotAllocator(4, True)),
    ("SlotAllocator(4, 1.5)", lambda: SlotAllocator(4, 1.5)),
    ("SlotAllocator(4, 1, 2**64)", lambda: SlotAllocator(4, 1, 2**64)),
    ("SlotAllocator(4, 1, 4, '16')", lambda: SlotAllocator(4, 1, 4, "16")),
    ("SlotAllocator(-4)", lambda: SlotAllocator(-4)),
    # Only the reserved page: nothing to hand out (its docstring: num_pages >= 2).
    ("SlotAllocator(1)", lambda: SlotAllocator(1)),
    ("SlotAllocator(4, host_pages=1)", lambda: SlotAllocator(4, host_pages=1)),
    ("SlotAllocator(4, host_pages=-1)", lambda: SlotAllocator(4, host_pages=-1)),
    ("SlotAllocator(4, host_pages=True)", lambda: SlotAllocator(4, host_pages=True)),
    ("SlotAllocator(4, host_pages=2.0)", lambda: SlotAllocator(4, host_pages=2.0)),
    ("SlotAllocator(4, host_pages=2**31)", lambda: SlotAllocator(4, host_pages=2**31)),
    ("SlotAllocator(4, host_policy='lru')", lambda: SlotAllocator(4, host_pages=2, host_policy="lru")),
    ("SlotAllocator(4, host_policy=1)", lambda: SlotAllocator(4, host_pages=2, host_policy=1)),
    ("SlotAllocator(max_pinned_pages=4) of 3", lambda: SlotAllocator(4, max_pinned_pages=4)),
    ("SlotAllocator(max_pinned_pages=-1)", lambda: SlotAllocator(4, max_pinned_pages=-1)),
    ("SlotAllocator(max_pinned_pages=1.0)", lambda: SlotAllocator(4, max_pinned_pages=1.0)),
    ("SlotAllocator(manual_clock=1)", lambda: SlotAllocator(4, manual_clock=1)),
    ("SlotAllocator(lazy_metadata=1)", lambda: SlotAllocator(4, lazy_metadata=1)),
    ("SlotAllocator(lazy_metadata='yes')", lambda: SlotAllocator(4, lazy_metadata="yes")),
    ("KVPool(max_pinned_pages=9) of 7", lambda: kvpool.KVPool(1, 1, 4, num_pages=8, max_pinned_pages=9)),
    ("KVPool(num_pages=2.9)", lambda: kvpool.KVPool(1, 1, 4, num_pages=2.9)),
    ("KVPool(num_pages=True)", lambda: kvpool.KVPool(1, 1, 4, num_pages=True)),
    ("KVPool(num_slots='8')", lambda: kvpool.KVPool(1, 1, 4, num_slots="8")),
    ("KVPool(num_layers=2.0)", lambda: kvpool.KVPool(2.0, 1, 4, num_pages=4)),
    ("KVPool(page_size='1')", lambda: kvpool.KVPool(1, 1, 4, num_pages=4, page_size="1")),
    ("KVPool(device='meta')", lambda: kvpool.KVPool(1, 1, 4, num_pages=4, device="meta")),
    ("KVPool(device=3.5)", lambda: kvpool.KVPool(1, 1, 4, num_pages=4, device=3.5)),
    ("KVPool(memory_fraction='0.5')", lambda: kvpool.KVPool(1, 1, 4, memory_fraction="0.5")),
    ("KVPool(memory_fraction=1.5)", lambda: kvpool.KVPool(1, 1, 4, memory_fraction=1.5)),
    ("KVPool(memory_fraction=nan)", lambda: kvpool.KVPool(1, 1, 4, memory_fraction=float("nan"))),
    ("KVPool(memory_bytes=inf)", lambda: kvpool.KVPool(1, 1, 4, memory_bytes=float("inf"))),
    ("KVPool(memory_bytes='1e9')", lambda: kvpool.KVPool(1, 1, 4, memory_bytes="1e9")),
    ("KVPool(memory_bytes=-1)", lambda: kvpool.KVPool(1, 1, 4, memory_bytes=-1)),
    # 2**15 + 1 pages of 2**16 slots: past the int32 req_to_token (refused
    # before any tensor is made, so this costs nothing).
    ("KVPool(> 2**31 slots)", lambda: kvpool.KVPool(1, 1, 1, num_pages=2**15 + 1, page_size=2**16)),
]


@pytest.mark.parametrize("name,call", CONSTRUCTOR_CASES, ids=[c[0] for c in CONSTRUCTOR_CASES])
def test_constructor_bad_input(name, call):
    with pytest.raises(KVPoolError) as info:
        call()
    assert type(info.value) is InvalidArgumentError, f"{name}: {type(info.value).__name__}: {info.value}"


def test_slot_limit_is_named_and_the_largest_pool_is_allowed():
    with pytest.raises(InvalidArgumentError, match=r"2\*\*31.*num_pages=32768"):
        kvpool.KVPool(1, 1, 1, num_pages=2**15 + 1, page_size=2**16)
    from kvpool.capacity import MAX_SLOTS, resolve_num_pages

    pages = resolve_num_pages(page_size=2**16, slot_bytes=4, fixed_bytes=0, num_pages=2**15, num_slots=None,
                              memory_bytes=None, memory_fraction=None, device=torch.device("cpu"))
    assert pages * 2**16 == MAX_SLOTS


POOL_CASES: list[tuple[str, type, Callable[[kvpool.KVPool, np.ndarray], Any]]] = [
    ("write uint64 2**63", SlotRangeError,
     lambda p, h: p.write(0, np.array([2, 2**63], dtype=np.uint64), *_rows(2))),
    ("write uint64 2**64-1", SlotRangeError,
     lambda p, h: p.write(0, np.array([2**64 - 1, 3], dtype=np.uint64), *_rows(2))),
    ("write [2**63]", SlotRangeError, lambda p, h: p.write(0, [2, 2**63], *_rows(2))),
    ("write [num_slots]", SlotRangeError, lambda p, h: p.write(0, [2, 16], *_rows(2))),
    ("open(True)", InvalidArgumentError, lambda p, h: p.open(True)),
    ("open(1.5)", InvalidArgumentError, lambda p, h: p.open(1.5)),
    ("open(2**64)", InvalidArgumentError, lambda p, h: p.open(2**64)),
    ("extend(h, 2**34)", ContextTooLongError, lambda p, h: p.extend(h, 2**34)),
    ("extend(h, True)", InvalidArgumentError, lambda p, h: p.extend(h, True)),
    ("extend(h, 1.0)", InvalidArgumentError, lambda p, h: p.extend(h, 1.0)),
    ("truncate(h, 1.5)", InvalidArgumentError, lambda p, h: p.truncate(h, 1.5)),
]


def _rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(n, 2, 4).half(), torch.ones(n, 2, 4).half()


@pytest.mark.parametrize("name,exc,call", POOL_CASES, ids=[c[0] for c in POOL_CASES])
def test_pool_bad_input(pool, name, exc, call):
    p, h = pool
    before = pool_state(p, h)
    with pytest.raises(KVPoolError) as info:
        call(p, h)
    assert type(info.value) is exc, f"{name}: {type(info.value).__name__}: {info.value}"
    assert pool_state(p, h) == before
    p.allocator.check()


CORE_CASES = [
    "from kvpool import SlotAllocator; SlotAllocator(4, 1, 2**31 - 1, 16)",
    "from kvpool import SlotAllocator; SlotAllocator(4, 1, 4, 2**31 - 1).open(4)",
]


@pytest.mark.parametrize("code", CORE_CASES)
def test_no_abort_on_huge_metadata(code):
    """Run in a child process: an infallible reservation of these sizes would abort the interpreter."""
    wrapped = (
        "import kvpool\n"
        f"try:\n    {code}\n    print('ok')\n"
        "except kvpool.KVPoolError as e:\n    print('typed', type(e).__name__)\n"
    )
    env = {**os.environ, "RUST_BACKTRACE": "0"}
    r = subprocess.run([sys.executable, "-c", wrapped], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, f"rc={r.returncode}: {r.stderr[-500:]}"
    assert r.stdout.startswith(("ok", "typed")), r.stdout
