"""SlotAllocator.admit(counts, table=, tokens=, out=): open + extend of the new
requests of a scheduler step in one call. It must give exactly what open
followed by extend gives, and a refused admission must change nothing: not
the pool, not the caller's table or out, not the handles the next open
hands out."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool import ContextTooLongError, InvalidArgumentError, KVPoolError, PoolExhaustedError, SlotAllocator, TooManyRequestsError
from kvpool.layout import padded_table


def twins(page_size: int) -> tuple[SlotAllocator, SlotAllocator]:
    pools = tuple(SlotAllocator(64 // page_size + 1, page_size, 6, 40, hash_seed=1, handle_seed=5) for _ in range(2))
    for a in pools:  # in use: one request running, one closed
        h = a.open(2)
        a.extend(h, [5, 3])
        a.close(h[1:])
    return pools  # type: ignore[return-value]


def view(a: SlotAllocator, handles: np.ndarray) -> tuple:
    return (
        [a.slots(int(h)).tolist() for h in handles],
        a.rows(handles).tolist(),
        a.lengths(handles).tolist(),
        a.free_pages,
        a.open_requests,
    )


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("with_table", [False, True])
@pytest.mark.parametrize("with_out", [False, True])
def test_admit_gives_what_open_then_extend_gives(page_size: int, with_table: bool, with_out: bool) -> None:
    a, b = twins(page_size)
    counts = np.array([7, 0, 12], dtype=np.int64)
    tokens = np.arange(19, dtype=np.int64)
    ta, tb = (padded_table(6, 40), padded_table(6, 40)) if with_table else (None, None)
    out = np.full(32, -3, dtype=np.int64) if with_out else None
    ha, sa = a.admit(counts, table=ta, tokens=tokens, out=out)
    hb = b.open(3)
    sb = b.extend(hb, counts, table=tb, tokens=tokens)
    assert ha.dtype == np.int64 and np.array_equal(ha, hb)
    if with_out:
        assert sa is out and np.array_equal(out[:19], sb) and (out[19:] == -3).all()
    else:
        assert np.array_equal(sa, sb)
    if with_table:
        assert np.array_equal(ta, tb)
    assert view(a, ha) == view(b, hb)
    for x, y in zip(ha, hb):
        assert np.array_equal(a.known_tokens(int(x)), b.known_tokens(int(y)))
    a.check()


def test_a_list_of_counts_and_an_empty_admission_work() -> None:
    a = SlotAllocator(9, 2, 4, 8)
    h, s = a.admit([3, 1])
    assert len(h) == 2 and a.lengths(h).tolist() == [3, 1] and len(s) == 4
    h, s = a.admit([])
    assert len(h) == 0 and len(s) == 0 and a.open_requests == 2
    a.check()


@pytest.mark.parametrize(
    "counts, kwargs, exc, match",
    [
        (5, {}, InvalidArgumentError, r"pass \[5\]"),
        ([1, 1, 1, 1], {}, TooManyRequestsError, "too many requests"),
        ([8, 4], {}, PoolExhaustedError, "free pages"),
        ([2, 9], {}, ContextTooLongError, "max_context_len"),
        ([2, -1], {}, InvalidArgumentError, "negative|>= 0"),
        ([2, 1.5], {}, InvalidArgumentError, "int"),
        ([2, 2], {"tokens": [1, 2, 3]}, InvalidArgumentError, "tokens"),
        ([2], {"tokens": [1, -4]}, InvalidArgumentError, "token id"),
        ([2], {"table": np.zeros((2, 8), np.int32)}, InvalidArgumentError, "table shape"),
        ([2], {"out": np.zeros(1, np.int64)}, InvalidArgumentError, "out holds 1"),
    ],
)
def test_a_refused_admission_changes_nothing(counts, kwargs, exc, match) -> None:
    def pool() -> tuple[SlotAllocator, np.ndarray]:
        a = SlotAllocator(9, 2, 4, 8, handle_seed=3)  # 8 usable pages of 2 slots
        h = a.open(2)
        a.extend(h, [3, 1])
        return a, h

    a, h = pool()
    twin, th = pool()
    table = np.full((4, 8), -7, dtype=np.int32)
    out = np.full(32, -7, dtype=np.int64)
    args = {"table": table, "out": out, **kwargs}
    before = view(a, h)
    with pytest.raises(exc, match=match) as info:
        a.admit(counts, **args)
    assert isinstance(info.value, KVPoolError)
    assert view(a, h) == before
    assert (table == -7).all() and (out == -7).all()
    a.check()
    # Not even the handles move: the next open matches a pool that never saw the call.
    assert np.array_equal(a.open(2), twin.open(2))


def test_admit_packed_is_open_then_extend_packed() -> None:
    a, b = twins(4)
    counts, tokens = [6, 0, 9], list(range(15))
    h, packed, n = a.admit_packed(counts, tokens=tokens)
    hb = b.open(3)
    packed_b, nb, cow = b.extend_packed(hb, counts, tokens=tokens)
    assert np.array_equal(h, hb) and n == nb == 3 and cow is None
    assert np.array_equal(packed, packed_b)
    assert view(a, h) == view(b, hb)
    before = view(a, h)
    with pytest.raises(PoolExhaustedError):
        a.admit_packed([40, 40])
    with pytest.raises(InvalidArgumentError, match="pass"):
        a.admit_packed(2)
    assert view(a, h) == before
    a.check()
