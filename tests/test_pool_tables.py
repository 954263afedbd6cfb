"""req_to_token and page tables stay equal to the allocator through any operation sequence.

The CPU pool has the Rust core write req_to_token in place (numpy view). The
device path (extend_with_starts + one H2D copy + one batched write) is run here
on CPU tensors too, with both the Triton-kernel hook (a row-by-row stand-in
with its signature) and the index_put_ fallback, so its host logic is covered without a
GPU.
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
from kvpool.transfer import update_req_to_token

MAX_REQ, MAX_LEN = 4, 24


def write_req_to_token_ref(
    table: torch.Tensor, rows: Any, starts: Any, counts: Any, slots: Any, offsets: Any = None
) -> None:
    """Stand-in for kvpool.kernels.write_req_to_token (same signature), row by row."""
    offset = 0
    for i, (r, s, c) in enumerate(zip(rows.tolist(), starts.tolist(), counts.tolist())):
        if offsets is not None:
            assert int(offsets[i]) == offset
        table[r, s : s + c] = slots[offset : offset + c].to(table.dtype)
        offset += c


def make_pool(page_size: int, path: str) -> kvpool.KVPool:
    pool = kvpool.KVPool(1, 1, 2, page_size=page_size, num_pages=64 // page_size + 1,
                         max_requests=MAX_REQ, max_context_len=MAX_LEN)
    if path != "cpu":
        # Take the device branch of extend() on CPU tensors.
        pool._table_np = None
        pool._table_kernel = write_req_to_token_ref if path == "kernel" else None
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


@pytest.mark.parametrize("path", ["cpu", "kernel", "fallback"])
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


@pytest.mark.parametrize("kernel", [None, write_req_to_token_ref], ids=["index_put", "kernel"])
def test_update_req_to_token_writes_exactly_the_given_ranges(kernel: Any) -> None:
    table = torch.full((5, 8), -7, dtype=torch.int32)
    rows = np.array([3, 0, 2], dtype=np.int64)
    starts = np.array([2, 0, 7], dtype=np.int64)
    counts = np.array([3, 0, 1], dtype=np.int64)
    slots = np.array([11, 12, 13, 14], dtype=np.int64)
    out = update_req_to_token(table, rows, starts, counts, slots, kernel)
    expected = torch.full((5, 8), -7, dtype=torch.int32)
    expected[3, 2:5] = torch.tensor([11, 12, 13], dtype=torch.int32)
    expected[2, 7] = 14
    assert torch.equal(table, expected)
    assert out.dtype == torch.int64 and out.tolist() == slots.tolist()


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


@pytest.mark.parametrize("path", ["cpu", "fallback"])
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
def test_device_table_update_passes_16_byte_aligned_segments(counts):
    """Triton specializes pointers on 16-byte alignment: every segment of the packed
    H2D buffer must stay aligned whatever the batch shape, or a new batch size would
    compile a new kernel variant while serving."""
    seen = []

    def fake_kernel(table, rows, starts, counts_d, slots, offsets):
        seen.append([x.data_ptr() % 16 for x in (rows, starts, counts_d, slots, offsets)])
        write_ref = table.view(-1)
        for r, s, c, o in zip(rows.tolist(), starts.tolist(), counts_d.tolist(), offsets.tolist()):
            write_ref[r * table.shape[1] + s : r * table.shape[1] + s + c] = slots[o : o + c].to(table.dtype)

    c = np.array(counts, dtype=np.int64)
    rows = np.arange(len(c), dtype=np.int64)
    starts = np.arange(len(c), dtype=np.int64)
    slots = np.arange(100, 100 + int(c.sum()), dtype=np.int64)
    table = torch.zeros((len(c) + 1, 16), dtype=torch.int32)
    out = update_req_to_token(table, rows, starts, c, slots, fake_kernel)
    assert seen == [[0] * 5]
    assert out.tolist() == slots.tolist()
    o = 0
    for r, (s, n) in enumerate(zip(starts, c)):
        assert table[r, s : s + n].tolist() == slots[o : o + n].tolist()
        o += n
