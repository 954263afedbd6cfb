"""One test per error kind: the exception type, and that the allocator state
(free counts, open requests, lengths, slots, a table passed in) is unchanged."""

import numpy as np
import pytest
import torch

import kvpool
from kvpool import (
    ContextTooLongError,
    InvalidArgumentError,
    InvalidHandleError,
    KVPoolError,
    PoolExhaustedError,
    SlotAllocator,
    TooManyRequestsError,
)


class Unreadable:
    """Stands in for a CUDA tensor: numpy cannot read it."""

    def __array__(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy")


@pytest.fixture
def busy():
    """An allocator with 3 of 4 rows open, a closed handle, and 3 free pages."""
    a = SlotAllocator(9, page_size=2, max_requests=4, max_context_len=8)  # 8 usable pages
    h = a.open(4)
    a.extend(h, [3, 1, 4, 0])  # 2 + 1 + 2 pages = 5 used, 3 free
    a.close(h[3:])
    return a, h[:3], int(h[3])


def state(a, h):
    return (
        a.free_pages,
        a.used_pages,
        a.open_requests,
        a.lengths(h).tolist(),
        [a.slots(x).tolist() for x in h],
        [a.pages(x).tolist() for x in h],
    )


def assert_fails_unchanged(a, h, exc, call, match=None):
    before = state(a, h)
    with pytest.raises(exc, match=match) as info:
        call()
    assert isinstance(info.value, KVPoolError)
    assert state(a, h) == before
    a.check()
    return info.value


def test_pool_exhausted_says_needed_vs_free(busy):
    a, h, _ = busy
    # Request 0 has a free half page; 4 tokens each need 2 + 2 + 2 pages > 3 free.
    err = assert_fails_unchanged(a, h, PoolExhaustedError, lambda: a.extend(h, 4))
    assert "needs 6 free pages" in str(err) and "only 3 are free" in str(err)
    assert not isinstance(err, ValueError)
    assert a.extend(h, [1, 1, 1]).size == 3  # a batch that fits still works afterwards


def test_exhausted_with_table_leaves_table_untouched(busy):
    a, h, _ = busy
    table = np.full((4, 8), -7, dtype=np.int32)
    assert_fails_unchanged(a, h, PoolExhaustedError, lambda: a.extend(h, 4, table=table))
    assert (table == -7).all()


@pytest.mark.parametrize("bad", ["closed", "duplicate"])
def test_decode_step_with_table_leaves_the_table_on_a_late_bad_handle(busy, bad):
    # A decode step (one token each) applies the valid requests before it
    # reaches the bad handle at the end; their table entries must not be
    # written (the table is filled only once the whole batch is valid).
    a, h, closed = busy
    table = np.full((4, 8), -7, dtype=np.int32)
    batch = np.append(h, closed if bad == "closed" else h[0])
    exc = InvalidHandleError if bad == "closed" else InvalidArgumentError
    assert_fails_unchanged(a, h, exc, lambda: a.extend(batch, 1, table=table))
    assert (table == -7).all()
    a.extend(h, 1, table=table)  # and the same step without the bad handle writes them
    for x in h:
        row, n = int(a.rows([x])[0]), int(a.length(x))
        assert table[row, n - 1] == a.slots(x)[-1]


@pytest.mark.parametrize("kind", ["closed", "stale", "unknown-row", "negative", "generation-0"])
def test_invalid_handle(busy, kind):
    a, h, closed = busy
    if kind == "stale":
        reopened = a.open(1)  # reuses the closed row with a new generation
        bad = closed
        assert int(reopened[0]) & 0xFFFFFFFF == closed & 0xFFFFFFFF
        h = np.concatenate([h, reopened])
    else:
        bad = {"closed": closed, "unknown-row": (1 << 32) | 4, "negative": -1, "generation-0": 1}[kind]
    batch = np.array([h[0], bad], dtype=np.int64)
    for call in [
        lambda: a.extend(batch, 1),
        lambda: a.extend_with_starts(batch, 1),
        lambda: a.truncate(batch, 0),
        lambda: a.close(batch),
        lambda: a.length(bad),
        lambda: a.lengths(batch),
        lambda: a.slots(bad),
        lambda: a.pages(bad),
        lambda: a.page_table(batch),
        lambda: a.rows(batch),
    ]:
        err = assert_fails_unchanged(a, h, InvalidHandleError, call)
        assert str(bad) in str(err)
    assert not a.is_open(bad)


def test_too_many_requests(busy):
    a, h, _ = busy
    err = assert_fails_unchanged(a, h, TooManyRequestsError, lambda: a.open(2))
    assert "max_requests=4" in str(err)
    assert a.open(1).size == 1


def test_context_too_long(busy):
    a, h, _ = busy
    # Request 2 holds 4 tokens; 4 more reach max_context_len=8 exactly, 5 do not.
    err = assert_fails_unchanged(a, h, ContextTooLongError, lambda: a.extend(h, [0, 0, 5]))
    assert "max_context_len=8" in str(err)
    assert a.extend(h[2:], 4).size == 4


@pytest.mark.parametrize("counts", [2**62, [2**62, 2**62, 2**62], [0, 0, 10**12]])
def test_huge_counts_are_refused_before_sizing_the_result(busy, counts):
    """extend sizes its result array from the counts before the core runs; an
    absurd count must still be a ContextTooLongError, never a MemoryError."""
    a, h, _ = busy
    assert_fails_unchanged(a, h, ContextTooLongError, lambda: a.extend(h, counts))
    assert_fails_unchanged(a, h, ContextTooLongError, lambda: a.extend_with_starts(h, counts))


@pytest.mark.parametrize(
    "call",
    [
        lambda a, h: a.extend(h, [1, -1, 1]),  # negative count
        lambda a, h: a.extend(h, [1, 1]),  # length mismatch
        lambda a, h: a.extend([h[0], h[1], h[0]], 1),  # duplicate handle
        lambda a, h: a.extend(h, 1.0),  # float
        lambda a, h: a.extend(h, np.ones(3)),  # float array
        lambda a, h: a.extend(h, np.ones(3, dtype=bool)),  # bool array
        lambda a, h: a.extend(h, True),  # bool
        lambda a, h: a.extend(h, [1, True, 1]),  # bool in a list
        lambda a, h: a.extend(h, np.ones((3, 1), dtype=np.int64)),  # 2-D
        lambda a, h: a.extend(h, torch.ones(3)),  # float tensor
        lambda a, h: a.extend(h, "123"),  # not numbers
        lambda a, h: a.extend(h, Unreadable()),  # e.g. a CUDA tensor
        lambda a, h: a.close(Unreadable()),
        lambda a, h: a.extend(h, [1, 2**64, 1]),  # out of int64 range
        lambda a, h: a.extend(h.astype(np.float64), 1),  # float handles
        lambda a, h: a.extend(h, 1, table=np.zeros((4, 8), dtype=np.int64)),  # table dtype
        lambda a, h: a.extend(h, 1, table=np.zeros(32, dtype=np.int32)),  # table ndim
        lambda a, h: a.extend(h, 1, table=np.zeros((3, 8), dtype=np.int32)),  # too few rows
        lambda a, h: a.extend(h, 1, table=np.zeros((4, 7), dtype=np.int32)),  # too few columns
        lambda a, h: a.extend(h, 1, table=np.zeros((8, 16), dtype=np.int32)[::2, ::2]),  # strided
        lambda a, h: a.extend(h, 1, table=[[0] * 8] * 4),  # not an array
        lambda a, h: a.extend(h, 1, table=np.zeros(129, np.uint8)[1:].view(np.int32).reshape(4, 8)),
        lambda a, h: a.truncate(h, [1, 2, 0]),  # longer than current length
        lambda a, h: a.truncate(h, -1),  # negative length
        lambda a, h: a.close([h[1], h[1]]),  # duplicate close
        lambda a, h: a.open(-1),  # negative n
        lambda a, h: a.length(h),  # array where one handle is expected
    ],
)
def test_invalid_argument(busy, call):
    a, h, _ = busy
    err = assert_fails_unchanged(a, h, InvalidArgumentError, lambda: call(a, h))
    assert isinstance(err, ValueError)


def test_read_only_table_is_rejected_before_any_change(busy):
    a, h, _ = busy
    table = np.zeros((4, 8), dtype=np.int32)
    table.flags.writeable = False
    assert_fails_unchanged(a, h, InvalidArgumentError, lambda: a.extend(h, 1, table=table), "writ")
    assert not table.any()


def test_dtype_and_ndim_are_named_in_messages(busy):
    a, h, _ = busy
    with pytest.raises(InvalidArgumentError, match="float64"):
        a.extend(h, np.ones(3))
    with pytest.raises(InvalidArgumentError, match="2-D"):
        a.extend(h, np.ones((3, 1), dtype=np.int32))
    with pytest.raises(InvalidArgumentError, match="more than once"):
        a.close([h[0], h[0]])


def test_too_long_a_new_request_is_named_as_new_not_by_a_handle():
    """A call that would open a request past max_context_len names it as new: no handle
    was issued (not the -1 placeholder, nor the handle the row would have had)."""
    a = SlotAllocator(64, 1, 4, 16)
    h = a.open(1)
    calls = [lambda: a.open_with_prefix(list(range(20)), [20]), lambda: a.admit([3, 20]),
             lambda: a.admit_packed([20])]
    for call in calls:
        with pytest.raises(ContextTooLongError, match=r"^context too long: a new request would reach 20 tokens"):
            call()
    with pytest.raises(ContextTooLongError, match=rf"^context too long: request {int(h[0])} would reach 17"):
        a.extend(h, 17)
    assert a.open_requests == 1 and a.used_pages == 0
    a.check()


@pytest.mark.parametrize("grouped", [False, True])
def test_forks_growing_together_copy_their_shared_page_once_fewer(grouped):
    # A parent and its fork share a partly filled last page. Growing both in one call
    # copies it once: the second to grow finds the page its own and writes in place.
    # With one free page the call fits, as the two extends one after another do.
    if grouped:
        a = kvpool.GroupedAllocator([{"kind": "full", "num_pages": 4, "page_size": 4},
                                     {"kind": "sliding", "num_pages": 4, "page_size": 4, "window": 8}], 4, 16)
        free = lambda: (a.free_pages(0), a.free_pages(1))  # noqa: E731
    else:
        a = kvpool.SlotAllocator(4, page_size=4, max_requests=4, max_context_len=16)
        free = lambda: a.free_pages  # noqa: E731
    parent = a.open(1)
    a.extend(parent, 6)  # pages 1 and 2; page 2 half filled
    kid = a.fork(int(parent[0]), 1)
    assert free() == ((1, 1) if grouped else 1)
    both = np.concatenate([parent, kid])
    a.extend(both, 1)
    assert free() == ((0, 0) if grouped else 0)
    assert list(a.lengths(both)) == [7, 7]
    a.check()
    # Three holders, two growing: both copy (the third still holds the page).
    b = kvpool.SlotAllocator(5, page_size=4, max_requests=4, max_context_len=16)
    p = b.open(1)
    b.extend(p, 6)
    kids = b.fork(int(p[0]), 2)
    assert b.free_pages == 2
    with pytest.raises(kvpool.PoolExhaustedError, match="needs 3"):
        b.extend(np.concatenate([p, kids]), [1, 1, 5])  # 2 copies + 1 new page for the 11th token
    b.extend(kids, 1)
    assert b.free_pages == 0
    b.check()


@pytest.mark.parametrize("call, message", [
    # (a nested list was reported as an element outside the int64 range)
    (lambda a, h: a.open_with_prefix([1, 2], [[2]]), r"^lengths must be a flat sequence of ints \(1-D\), got a nested"),
    (lambda a, h: a.extend(h, [[1], [1]]), r"^counts must be a flat sequence of ints \(1-D\), got a nested list"),
    (lambda a, h: kvpool._core.page_hashes([[1, 2]], 2, 1), r"^tokens must be a flat sequence of ints"),
    # (">= 0" sent the caller to 0, refused next with ">= 1")
    (lambda a, h: kvpool._core.page_hashes([1, 2], -1, 1), r"^page_size must be >= 1, got -1$"),
    (lambda a, h: kvpool._core.page_hashes([1, 2], 0, 1), r"^page_size must be >= 1, got 0$"),
    # (the advice was "pass [-1] to admit one request", refused next as negative)
    (lambda a, h: a.admit(-1), r"^admit takes one count \(>= 0\) per new request, got the single int -1$"),
    # (None was "got dtype object": numpy's reading of it)
    (lambda a, h: a.extend(h, None), r"^counts must be an int or ints, got NoneType None$"),
    (lambda a, h: a.close(None), r"^handles must be an int or ints, got NoneType None$"),
], ids=["nested-lengths", "nested-counts", "nested-tokens", "page-size-negative", "page-size-zero", "admit-negative",
        "counts-none", "handles-none"])
def test_messages_name_the_actual_mistake(call, message):
    a = SlotAllocator(16, page_size=2, max_requests=4, max_context_len=8)
    h = a.open(2)
    before = (a.free_pages, a.open_requests, a.lengths(h).tolist())
    with pytest.raises(InvalidArgumentError, match=message):
        call(a, h)
    assert (a.free_pages, a.open_requests, a.lengths(h).tolist()) == before
    a.check()
