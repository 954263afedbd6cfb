"""req_to_token and page tables stay equal to the allocator through any operation sequence.

The CPU pool has the Rust core write req_to_token in place (numpy view). The
device path (extend_packed + one H2D copy + kvpool.kernels.write_req_to_token)
is run here on CPU tensors too (the kernels' torch backend does the write), so
its host logic is covered without a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpool
from kvpool import KVPoolError
from kvpool.tables import update_req_to_token

MAX_REQ, MAX_LEN = 4, 24


def make_pool(page_size: int, path: str) -> kvpool.KVPool:
    pool = kvpool.KVPool(1, 1, 2, page_size=page_size, num_pages=64 // page_size + 1,
                         max_requests=MAX_REQ, max_context_len=MAX_LEN)
    if path == "device":
        # Take the device branch of extend() on CPU tensors.
        pool._table_np = None
    return pool


def check_tables(pool: kvpool.KVPool, handles: list[int]) -> None:
    a = pool.allocator
    for h in handles:
        row = int(a.rows(h)[0])
        n = a.length(h)
        assert pool.req_to_token[row, :n].tolist() == a.slots(h).tolist()
    assert not pool.req_to_token[pool.null_row].any(), "the null row must stay all zeros"
    if handles:
        pt = pool.page_table(handles)
        indptr, indices, last = a.page_table(handles)
        assert pt.kv_indptr.tolist() == indptr.tolist()
        assert pt.kv_indices.tolist() == indices.tolist()
        assert pt.kv_last_page_len.tolist() == last.tolist()
        assert all(t.dtype == torch.int32 for t in pt)
    a.check()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["open", "extend", "extend", "extend", "truncate", "close", "reset"]),
        st.lists(st.integers(0, 9), min_size=1, max_size=MAX_REQ),
        st.integers(0, 2**16),
    ),
    max_size=25,
)


@pytest.mark.parametrize("path", ["cpu", "device"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, page_size=st.sampled_from([1, 4]))
def test_req_to_token_matches_allocator_after_random_ops(ops: list[Any], page_size: int, path: str) -> None:
    pool = make_pool(page_size, path)
    handles: list[int] = pool.open(2).tolist()
    for op, nums, pick in ops:
        chosen = [handles[(pick + i) % len(handles)] for i in range(len(nums))] if handles else []
        chosen = list(dict.fromkeys(chosen))  # duplicates in one batch are an error; keep it valid
        table_before = pool.req_to_token.clone()
        try:
            if op == "open":
                handles += pool.open(1).tolist()
            elif op == "extend" and chosen:
                res = pool.extend(chosen, nums[: len(chosen)])
                assert res.out_cache_loc.tolist() == res.slots.tolist()
                assert (res.slots >= page_size).all(), "page 0 is never handed out"
            elif op == "truncate" and chosen:
                lens = pool.allocator.lengths(chosen)
                pool.truncate(chosen, [min(int(n), x) for n, x in zip(lens, nums)])
            elif op == "close" and chosen:
                pool.close(chosen[:1])
                handles.remove(chosen[0])
            elif op == "reset":
                pool.reset()
                handles = []
        except KVPoolError:
            # Exhausted / too many / too long: atomic, the table is untouched.
            assert torch.equal(pool.req_to_token, table_before)
        check_tables(pool, handles)


def packed_extend(counts: list[int], lengths: list[int] | None = None) -> tuple[Any, np.ndarray, int, list[int]]:
    """An allocator whose requests have ``lengths`` tokens, then one extend_packed by ``counts``."""
    a = kvpool.SlotAllocator(64, 1, 8, 64)
    h = a.open(len(counts))
    if lengths is not None:
        a.extend(h, lengths)
    packed, b, cow = a.extend_packed(h, counts)
    assert cow is None  # nothing shared, nothing copied
    return a, packed, b, h.tolist()


@pytest.mark.parametrize("counts", [[1], [1, 2], [3, 0, 5], [0], [2, 2, 2, 1, 7]])
def test_extend_packed_layout(counts: list[int]) -> None:
    lengths = [i + 1 for i in range(len(counts))]
    a, packed, b, handles = packed_extend(counts, lengths)
    s = b + (b & 1)
    assert b == len(counts) and packed.dtype == np.int64 and packed.shape == (4 * s + sum(counts),)
    rows, starts, cnts, offsets = packed[: 4 * s].reshape(4, s)[:, :b]
    assert rows.tolist() == a.rows(handles).tolist()
    assert starts.tolist() == lengths
    assert cnts.tolist() == counts
    assert offsets.tolist() == (np.cumsum(counts) - counts).tolist()
    assert not packed[: 4 * s].reshape(4, s)[:, b:].any(), "padding columns are zero"
    slots = packed[4 * s :]
    for h, first, c, o in zip(handles, starts, cnts, offsets):
        assert a.slots(h)[first : first + c].tolist() == slots[o : o + c].tolist()


def test_extend_packed_scalar_count_and_errors_leave_pool_unchanged() -> None:
    a = kvpool.SlotAllocator(8, 1, 4, 16)
    h = a.open(3)
    packed, b, _ = a.extend_packed(h, 2)
    assert b == 3 and packed[8:12].tolist() == [2, 2, 2, 0]
    free = a.free_pages
    with pytest.raises(kvpool.PoolExhaustedError):
        a.extend_packed(h, 5)
    with pytest.raises(kvpool.InvalidArgumentError):
        a.extend_packed(h, [1, -1, 1])
    assert a.free_pages == free and a.lengths(h).tolist() == [2, 2, 2]
    a.check()


def test_update_req_to_token_writes_exactly_the_given_ranges() -> None:
    _, packed, b, _ = packed_extend([3, 0, 1], [2, 0, 7])
    table = torch.full((9, 64), -7, dtype=torch.int32)
    expected = table.clone()
    host, out = update_req_to_token(table, packed, b)
    s = b + (b & 1)
    rows, starts, counts, offsets = packed[: 4 * s].reshape(4, s)[:, :b]
    for r, first, c, o in zip(rows, starts, counts, offsets):
        expected[r, first : first + c] = torch.from_numpy(host[o : o + c]).int()
    assert torch.equal(table, expected)
    assert out.dtype == torch.int64 and out.tolist() == host.tolist() == packed[4 * s :].tolist()


def test_cpu_extend_is_zero_copy_into_req_to_token() -> None:
    pool = make_pool(1, "cpu")
    assert pool._table_np is not None
    assert pool._table_np.ctypes.data == pool.req_to_token.data_ptr()
    h = pool.open(1)
    res = pool.extend(h, 3)
    assert res.out_cache_loc.data_ptr() == res.slots.ctypes.data  # from_numpy, no copy
    assert pool.req_to_token[int(pool.rows(h)[0]), :3].tolist() == res.slots.tolist()


def test_truncate_then_extend_overwrites_stale_entries() -> None:
    pool = make_pool(4, "cpu")
    h = pool.open(1)
    pool.extend(h, 10)
    pool.truncate(h, 3)
    pool.extend(h, 4)
    check_tables(pool, h.tolist())


@pytest.mark.parametrize("path", ["cpu", "device"])
def test_concurrent_extends_from_threads_keep_tables_exact(path: str) -> None:
    # The allocator is internally locked; each thread owns its requests, so
    # their req_to_token rows must come out exactly as the allocator says.
    from concurrent.futures import ThreadPoolExecutor

    pool = make_pool(1, path)

    def worker(seed: int) -> list[int]:
        rng = np.random.default_rng(seed)
        with torch.inference_mode() if seed % 2 else torch.no_grad():
            h = pool.open(1)
            for _ in range(6):
                pool.extend(h, int(rng.integers(0, 3)))
        return h.tolist()

    with ThreadPoolExecutor(4) as ex:
        handles = [h for hs in ex.map(worker, range(4)) for h in hs]
    check_tables(pool, handles)
    assert not pool.req_to_token.is_inference()


@pytest.mark.parametrize("counts", [[1], [1, 2], [3, 0, 5], [2, 2, 2, 1, 7]])
def test_device_table_update_passes_16_byte_aligned_segments(counts, monkeypatch):
    """Triton specializes pointers on 16-byte alignment: every segment of the packed
    H2D buffer must stay aligned whatever the batch shape, or a new batch size would
    compile a new kernel variant while serving."""
    from kvpool import tables

    seen = []
    real = tables.write_packed_table

    def spy(table, rows, starts, counts_d, slots, offsets):
        seen.append([x.data_ptr() % 16 for x in (rows, starts, counts_d, slots, offsets)])
        real(table, rows, starts, counts_d, slots, offsets)

    monkeypatch.setattr(tables, "write_packed_table", spy)
    _, packed, b, _ = packed_extend(counts)
    table = torch.zeros((9, 64), dtype=torch.int32)
    host, out = update_req_to_token(table, packed, b)
    assert seen == [[0] * 5]
    assert out.tolist() == host.tolist()
