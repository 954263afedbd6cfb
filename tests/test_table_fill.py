"""open_with_prefix(table=) and fork(table=): a request that gets slots without
extending into them (a prefix hit, a fork) gets them in the caller's
request-to-token table too, so an engine never reads them back with slots()."""

from __future__ import annotations

import numpy as np
import pytest

import kvpool
from kvpool import InvalidArgumentError, InvalidHandleError
from kvpool.layout import padded_table


def served(page_size: int) -> tuple[kvpool.SlotAllocator, np.ndarray]:
    """An allocator whose cache holds a 13-token prompt's full pages."""
    a = kvpool.SlotAllocator(256, page_size, 8, 64, hash_seed=3)
    prompt = np.arange(100, 113)
    h, cached = a.open_with_prefix(prompt, [13])
    a.extend(h, 13 - int(cached[0]))
    a.close(h, cache=True)
    return a, prompt


def row_of(a: kvpool.SlotAllocator, h: int) -> int:
    return int(a.rows([h])[0])


@pytest.mark.parametrize("page_size", [1, 4])
def test_open_with_prefix_writes_each_hit_into_its_row(page_size: int) -> None:
    a, prompt = served(page_size)
    table = padded_table(8, 64)
    table.fill(-7)
    miss = np.arange(900, 905)
    h, cached = a.open_with_prefix(np.concatenate([prompt, miss]), [13, 5], table=table)
    assert cached.tolist() == [12, 0]
    r = row_of(a, h[0])
    assert table[r, :12].tolist() == a.slots(h[0]).tolist()
    assert (table[r, 12:] == -7).all()
    assert (table[row_of(a, h[1])] == -7).all()  # a miss has nothing to write
    a.check()


def test_fork_writes_the_parents_slots_into_each_new_row() -> None:
    a, prompt = served(4)
    table = padded_table(8, 64)
    h, _ = a.open_with_prefix(prompt, [13], table=table)
    a.extend(h, 1, table=table)
    kids = a.fork(int(h[0]), 3, table=table)
    for k in kids:
        assert table[row_of(a, int(k)), :13].tolist() == a.slots(int(h[0])).tolist()
    # Copy-on-write moves a kid's shared partial page: extend(table=) rewrites it.
    a.extend(kids[:1], 1, table=table)
    k0 = int(kids[0])
    assert table[row_of(a, k0), :14].tolist() == a.slots(k0).tolist()


@pytest.mark.parametrize("bad", ["float", "uint32", "big-endian", "too-small", "read-only"])
def test_a_bad_table_is_refused_before_anything_opens(bad: str) -> None:
    a, prompt = served(4)
    parent, _ = a.open_with_prefix(prompt, [13])
    table = {
        "float": np.zeros((8, 64), dtype=np.float32),
        "uint32": np.zeros((8, 64), dtype=np.uint32),
        "big-endian": np.zeros((8, 64), dtype=">i4" if np.little_endian else "<i4"),
        "too-small": np.zeros((8, 63), dtype=np.int32),
        "read-only": np.zeros((8, 64), dtype=np.int32),
    }[bad]
    table.flags.writeable = bad != "read-only"
    before = (a.open_requests, a.free_pages, a.hit_tokens, table.copy())
    with pytest.raises(InvalidArgumentError, match="table"):
        a.open_with_prefix(prompt, [13], table=table)
    with pytest.raises(InvalidArgumentError, match="table"):
        a.fork(int(parent[0]), 2, table=table)
    assert (a.open_requests, a.free_pages, a.hit_tokens) == before[:3]
    assert np.array_equal(table, before[3])
    a.check()


@pytest.mark.parametrize("dtype", [np.int32, np.intc, "=i4"])
def test_every_spelling_of_native_int32_is_a_table(dtype) -> None:
    # The table's dtype is checked by kind and size, not by numpy's type
    # number, which differs between spellings of int32 on some platforms.
    a, prompt = served(4)
    table = np.zeros((8, 64), dtype=dtype)
    h, cached = a.open_with_prefix(prompt, [13], table=table)
    assert table[row_of(a, int(h[0])), : int(cached[0])].tolist() == a.slots(int(h[0])).tolist()


def test_fork_of_a_closed_handle_writes_nothing() -> None:
    a, prompt = served(4)
    h, _ = a.open_with_prefix(prompt, [13])
    a.close(h)
    table = np.full((8, 64), -7, dtype=np.int32)
    with pytest.raises(InvalidHandleError):
        a.fork(int(h[0]), 2, table=table)
    assert (table == -7).all()
