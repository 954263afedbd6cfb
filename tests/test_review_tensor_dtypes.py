"""Outside-style sweep: what dtypes of K/V rows and slots the pool and the kernels take, as
their docs say (store_kv converts rows of another cache dtype, KVPool.write refuses them;
slots of any integer numpy dtype are taken by value, tensors only as int32/int64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool import KVPool
from kvpool.errors import TensorDtypeError
from kvpool.kernels import gather_kv, store_kv
from kvpool.torch_types import CACHE_DTYPES

# Exactly representable in every cache dtype (fp8 e5m2 included): every conversion is exact.
VALUES = torch.tensor([0, 0.25, -0.5, 0.75, 1, -1.5, 2, -3, 4, 6, -8])


def rows(n, h, d, dtype, sign=1):
    return (sign * VALUES[torch.arange(n * h * d) % len(VALUES)]).view(n, h, d).to(dtype)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("row_dtype", CACHE_DTYPES, ids=str)
def test_store_kv_converts_rows_of_another_cache_dtype(cache_dtype, row_dtype):
    k_cache, v_cache = torch.zeros(8, 2, 4, dtype=cache_dtype), torch.zeros(8, 2, 4, dtype=cache_dtype)
    k, v = rows(3, 2, 4, row_dtype), rows(3, 2, 4, row_dtype, -1)
    slots = torch.tensor([5, -1, 2])
    store_kv(k_cache, v_cache, slots, k, v)
    got_k, got_v = gather_kv(k_cache, v_cache, slots, out_dtype=torch.float32)
    keep = torch.tensor([0, 2])
    assert torch.equal(got_k[keep], k.float()[keep]) and torch.equal(got_v[keep], v.float()[keep])
    assert not got_k[1].any()


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
def test_pool_write_refuses_rows_of_another_dtype(dtype):
    pool = KVPool(1, 2, 4, dtype=dtype, num_pages=8, max_requests=2, max_context_len=8)
    slots = pool.extend(pool.open(1), [3]).out_cache_loc
    before = [t.clone() for _, t in pool.named_tensors()]
    for other in CACHE_DTYPES + (torch.float64,):
        if other == pool.compute_dtype:
            continue
        with pytest.raises(TensorDtypeError, match="no silent casts"):
            pool.write(0, slots, rows(3, 2, 4, other), rows(3, 2, 4, other))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, (_, b) in zip(before, pool.named_tensors()))
    pool.check()


@pytest.mark.parametrize("np_dtype", [np.uint8, np.int16, np.uint16, np.uint32, np.int32, np.int64])
def test_numpy_slots_of_any_integer_dtype_are_taken_by_value(np_dtype):
    pool = KVPool(1, 2, 4, dtype=torch.float32, num_pages=8, max_requests=2, max_context_len=8)
    slots = np.asarray(pool.extend(pool.open(1), [3]).slots)
    k = rows(3, 2, 4, torch.float32)
    pool.write(0, slots.astype(np_dtype), k, -k)
    got_k, got_v = pool.read(0, slots.astype(np_dtype))
    assert torch.equal(got_k, k) and torch.equal(got_v, -k)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.bool, torch.float32])
def test_slot_tensors_other_than_int32_int64_are_refused(dtype):
    pool = KVPool(1, 2, 4, dtype=torch.float32, num_pages=8, max_requests=2, max_context_len=8)
    slots = torch.as_tensor(pool.extend(pool.open(1), [3]).slots)
    k = rows(3, 2, 4, torch.float32)
    with pytest.raises(TensorDtypeError, match="int32 or torch.int64"):
        pool.write(0, slots.to(dtype), k, k)
    with pytest.raises(TensorDtypeError, match="int32 or torch.int64"):
        pool.read(0, slots.to(dtype))
    assert not pool.read(0, slots)[0].any()
