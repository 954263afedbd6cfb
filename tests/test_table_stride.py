"""extend(table=) into a req_to_token whose rows are padded (a column slice of
a wider array, as KVPool allocates it), and the padding rule itself."""

from __future__ import annotations

import numpy as np
import pytest

import kvpool
from kvpool.layout import padded_row_stride


@pytest.mark.parametrize("width", [1, 15, 16, 17, 128, 4096, 5120, 8192])
def test_padded_row_stride_is_an_odd_number_of_cache_lines(width: int) -> None:
    s = padded_row_stride(width)
    assert s >= width and s % 16 == 0 and (s // 16) % 2 == 1
    assert s - width < 32  # at most one line beyond rounding up


def test_extend_writes_a_padded_table_at_its_row_stride() -> None:
    a = kvpool.SlotAllocator(64, 4, 3, 20)
    full = np.full((3, padded_row_stride(20)), -7, dtype=np.int32)
    table = full[:, :20]
    assert not table.flags.c_contiguous
    h = a.open(3)
    slots = a.extend(h, [5, 0, 9], table)
    more = a.extend(h[2:], 1, table=table)
    rows = a.rows(h)
    assert list(table[rows[0], :5]) == list(slots[:5])
    assert list(table[rows[2], :10]) == list(slots[5:]) + list(more)
    assert (table[rows[1]] == -7).all()
    assert (full[:, 20:] == -7).all(), "the padding columns were written"


@pytest.mark.parametrize("make", [
    lambda t: t[::-1],  # negative row stride
    lambda t: np.asfortranarray(t),  # columns contiguous, rows not
    lambda t: t[:, ::2],  # strided columns
])
def test_tables_without_contiguous_forward_rows_are_refused(make) -> None:
    a = kvpool.SlotAllocator(64, 4, 3, 8)
    bad = make(np.zeros((3, 16), dtype=np.int32))
    h = a.open(1)
    before = a.free_slots
    with pytest.raises(kvpool.InvalidArgumentError, match="contiguous rows"):
        a.extend(h, 2, table=bad)
    assert a.free_slots == before and a.length(int(h[0])) == 0
