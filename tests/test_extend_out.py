"""extend(..., out=): the new slots go into a caller's int64 buffer kept from
step to step (as vLLM's model runner keeps its slot_mapping buffer) instead
of a new array; the buffer is written only when the call succeeds, and a bad
buffer is refused before anything changes."""

from __future__ import annotations

import numpy as np
import pytest
from test_allocator_errors import assert_fails_unchanged

from kvpool import InvalidArgumentError, InvalidHandleError, KVPoolError, PoolExhaustedError, SlotAllocator
from kvpool.layout import padded_table


def twin_pools(page_size: int) -> tuple[SlotAllocator, SlotAllocator]:
    """Two allocators that hand out the same handles and slots for the same calls."""
    return tuple(  # type: ignore[return-value]
        SlotAllocator(64, page_size, 8, 64, hash_seed=1, handle_seed=5) for _ in range(2)
    )


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("with_table", [False, True])
def test_out_gets_exactly_the_slots_a_new_array_would(page_size: int, with_table: bool) -> None:
    a, b = twin_pools(page_size)
    ta, tb = padded_table(8, 64), padded_table(8, 64)
    ha, hb = a.open(5), b.open(5)
    assert ha.tolist() == hb.tolist()
    out = np.full(64, -1, dtype=np.int64)
    for counts in ([3, 0, 7, 1, 2], 1, 1, [0, 4, 1, 5, 2], 1):
        want = a.extend(ha, counts, table=ta if with_table else None)
        got = b.extend(hb, counts, table=tb if with_table else None, out=out)
        assert got is out
        assert out[: len(want)].tolist() == want.tolist()
        assert (out[len(want) :] == -1).all() or len(want) == 0  # past the slots: untouched
        out[:] = -1
    assert [b.slots(int(x)).tolist() for x in hb] == [a.slots(int(x)).tolist() for x in ha]
    if with_table:
        assert (ta == tb).all()
    b.check()


def test_out_with_cow_returns_out_and_the_copies() -> None:
    a = SlotAllocator(64, 4, 8, 64, hash_seed=1)
    h, _ = a.open_with_prefix(np.arange(6), [6])
    a.extend(h, 6)
    kids = a.fork(int(h[0]), 1)
    out = np.zeros(4, dtype=np.int64)
    got, cow = a.extend(kids, 1, cow=True, out=out)
    assert got is out
    assert out[0] == a.slots(int(kids[0]))[-1]
    assert cow is not None and len(cow) == 4 * 2  # positions 4 and 5 moved off the shared page
    a.check()


def test_a_zero_slot_call_accepts_an_empty_out() -> None:
    a = SlotAllocator(16, 4, 4, 16)
    h = a.open(2)
    out = np.empty(0, dtype=np.int64)
    assert a.extend(h, 0, out=out) is out
    # numpy flags an empty view at an odd address aligned; nothing is written through it.
    odd = np.zeros(9, dtype=np.uint8)[1:9].view(np.int64)[:0]
    assert a.extend(h, 0, out=odd) is odd


def test_a_call_large_enough_to_release_the_gil_fills_out_too() -> None:
    a, b = (SlotAllocator(1024, 16, 4, 8192, handle_seed=9) for _ in range(2))
    ha, hb = a.open(2), b.open(2)
    out = np.full(7000, -1, dtype=np.int64)
    want = a.extend(ha, [3000, 3500])
    assert b.extend(hb, [3000, 3500], out=out) is out
    assert out[:6500].tolist() == want.tolist() and (out[6500:] == -1).all()
    b.check()


@pytest.fixture
def busy() -> tuple[SlotAllocator, np.ndarray]:
    a = SlotAllocator(9, 2, 4, 8)  # 8 usable pages of 2 slots
    h = a.open(3)
    a.extend(h, [3, 1, 4])
    return a, h


@pytest.mark.parametrize("bad", ["duplicate", "closed", "exhausted", "too-long"])
def test_a_failing_call_leaves_out_and_the_pool_as_they_were(busy, bad: str) -> None:
    a, h = busy
    out = np.full(16, -7, dtype=np.int64)
    table = np.full((4, 8), -7, dtype=np.int32)
    if bad == "duplicate":
        call, exc, match = (lambda: a.extend(np.append(h, h[0]), 1, table=table, out=out)), InvalidArgumentError, "more than once"
    elif bad == "closed":
        gone = a.open(1)
        a.close(gone)
        call, exc, match = (lambda: a.extend(np.append(h, gone), 1, table=table, out=out)), InvalidHandleError, "closed"
    elif bad == "exhausted":
        call, exc, match = (lambda: a.extend(h, 4, table=table, out=out)), PoolExhaustedError, "free pages"
    else:
        call, exc, match = (lambda: a.extend(h, [1, 1, 5], table=table, out=out)), KVPoolError, "max_context_len|too long"
    # The decode loop (one token each) has written slots before it meets the
    # bad request; none of them may reach `out` or the table.
    assert_fails_unchanged(a, h, exc, call, match)
    assert (out == -7).all() and (table == -7).all()


def _overlapping() -> tuple[np.ndarray, np.ndarray]:
    buf = np.zeros(4 * 8 + 16, dtype=np.int32)
    return buf[: 4 * 8].reshape(4, 8), buf[16:].view(np.int64)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: np.zeros(2, dtype=np.int64), "holds 2 entries but this call writes 3"),
        (lambda: np.zeros(8, dtype=np.int32), "1-D int64"),
        (lambda: np.zeros((2, 8), dtype=np.int64), "1-D int64"),
        (lambda: np.zeros(8, dtype=np.int64).astype(">i8"), "1-D int64"),
        (lambda: np.zeros(16, dtype=np.int64)[::2], "contiguous"),
        (lambda: np.zeros(8, dtype=np.float64), "1-D int64"),
        (lambda: [0] * 8, "numpy array"),
        ("read-only", "not writ"),
        ("overlaps-table", "share memory"),
    ],
)
def test_a_bad_out_is_refused_before_any_change(busy, make, match: str) -> None:
    a, h = busy
    table = None
    if make == "read-only":
        out = np.zeros(8, dtype=np.int64)
        out.flags.writeable = False
    elif make == "overlaps-table":
        table, out = _overlapping()
    else:
        out = make()
    assert_fails_unchanged(a, h, InvalidArgumentError, lambda: a.extend(h, 1, table=table, out=out), match)
