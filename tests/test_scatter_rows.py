"""A CPU pool's ``write`` stores through the core's ``scatter_rows`` (a ``memcpy`` a row):
the same bytes as ``index_copy_``, every slot checked before anything is written, and
torch's path for every tensor the core does not take."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
from kvpool import SlotRangeError
from kvpool._core import scatter_rows
from kvpool.rows import scatter_into

# scatter_rows stores in place only through torch's DLPack C exchange API; a torch without it
# (2.4) declines every call to torch's own path, so these cases of the in-place path skip there.
NEEDS_EXCHANGE_API = pytest.mark.skipif(not hasattr(torch._C, "_dlpack_exchange_api"),
                                        reason="this torch has no DLPack C exchange API: scatter_rows declines every call")

H, D = 2, 8


def snapshot(pool: kvpool.KVPool) -> list[bytes]:
    return [t.contiguous().view(torch.uint8).numpy().tobytes() for _, t in pool.named_tensors()]


def random_rows(n: int, dtype: torch.dtype, seed: int, width: int = D) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, width, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout,page", [("token", 1), ("paged", 4)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_stores_what_index_copy_stores(dtype, layout, page, slot_dtype):
    pool = kvpool.KVPool(2, H, D, dtype=dtype, page_size=page, num_pages=64 // page + 2, max_requests=4,
                         max_context_len=32, layout=layout)
    res = pool.extend(pool.open(3), [5, 1, 7])
    slots = res.out_cache_loc.to(slot_dtype)
    # Padding among them: skipped by both.
    slots = torch.cat([slots[:4], torch.tensor([-1], dtype=slot_dtype), slots[4:]])
    k, v = random_rows(len(slots), dtype, 1), random_rows(len(slots), dtype, 2)
    keep = (slots >= 0).nonzero().squeeze(1)
    want = [c.clone() for c in pool._row_caches[1]]
    for cache, src in zip(want, (k, v)):
        cache.index_copy_(0, slots[keep].long(), src[keep])
    others = [c.clone() for c in pool._row_caches[0]]
    pool.write(1, slots, k, v)
    for got, exp in zip(pool._row_caches[1], want):
        assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8))
    for got, exp in zip(pool._row_caches[0], others):  # the other layer is untouched
        assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8))


def test_mla_write_stores_the_latent():
    pool = kvpool.KVPool(2, 1, 12, dtype=torch.bfloat16, page_size=4, num_pages=8, max_requests=2,
                         max_context_len=16, kv_lora_rank=8, qk_rope_head_dim=4)
    res = pool.extend(pool.open(1), 6)
    kv = torch.randn(6, 1, 12).bfloat16()
    pool.write(0, res.out_cache_loc, kv)
    got, _ = pool.read(0, res.out_cache_loc)
    assert torch.equal(got, kv)


@pytest.mark.parametrize("where", [0, -1])
def test_a_bad_slot_anywhere_in_a_pool_made_tensor_writes_nothing(where):
    """torch's index_copy_ stored the rows before the bad one; the core checks them all first."""
    pool = kvpool.KVPool(2, H, D, dtype=torch.float16, page_size=4, num_pages=16, max_requests=4,
                         max_context_len=16)
    res = pool.extend(pool.open(2), [3, 2])
    before = snapshot(pool)
    res.slots[where] = pool.num_slots + 7  # behind torch's back: the slots skip the value check
    with pytest.raises(SlotRangeError, match=str(pool.num_slots + 7)):
        pool.write(0, res.out_cache_loc, random_rows(5, torch.float16, 0), random_rows(5, torch.float16, 1))
    assert snapshot(pool) == before


def test_the_write_bumps_the_caches_version_so_autograd_sees_it():
    pool = kvpool.KVPool(1, H, D, dtype=torch.float32, page_size=1, num_pages=8, max_requests=2,
                         max_context_len=8)
    res = pool.extend(pool.open(1), 2)
    w = torch.ones(D, requires_grad=True)
    out = (pool.k_buffer(0)[: 4] * w).sum()  # saves a view of the cache for backward
    before = pool.k_buffer(0)._version
    pool.write(0, res.out_cache_loc, torch.ones(2, H, D), torch.ones(2, H, D))
    assert pool.k_buffer(0)._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_a_large_write_is_the_same_with_the_gil_released():
    """Past 1 MiB the copy runs without the GIL: another thread keeps running meanwhile."""
    n = 2048
    pool = kvpool.KVPool(1, 8, 64, dtype=torch.float32, page_size=16, num_pages=n // 16 + 2, max_requests=1,
                         max_context_len=n)
    res = pool.extend(pool.open(1), n)
    k, v = torch.randn(n, 8, 64), torch.randn(n, 8, 64)
    assert k.numel() * 4 * 2 > 1 << 20
    pool.write(0, res.out_cache_loc, k, v)
    gk, gv = pool.read(0, res.out_cache_loc)
    assert torch.equal(gk, k) and torch.equal(gv, v)


def test_rows_under_inference_mode_and_with_grad_are_stored():
    pool = kvpool.KVPool(1, H, D, dtype=torch.float32, page_size=1, num_pages=8, max_requests=2,
                         max_context_len=8)
    res = pool.extend(pool.open(1), 2)
    with torch.inference_mode():
        k = torch.full((2, H, D), 3.0)
    v = torch.full((2, H, D), 4.0, requires_grad=True)
    pool.write(0, res.out_cache_loc, k, v)
    gk, gv = pool.read(0, res.out_cache_loc)
    assert torch.equal(gk, k) and torch.equal(gv, v.detach())
    assert not pool.k_buffer(0).requires_grad


# ----- the binding itself: what it refuses, it leaves to torch without touching anything

def caches(rows: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(rows, H, D), torch.zeros(rows, H, D)


def untouched(cs) -> bool:
    return all(not c.any() for c in cs)


def odd_calls():
    c = caches()
    src = torch.ones(2, H, D)
    idx = torch.tensor([1, 2])
    wide = torch.ones(2, H, D * 2)
    yield "non-contiguous source", c, idx, (wide[..., ::2], src)
    yield "a Parameter source", c, idx, (torch.nn.Parameter(src.clone()), src)
    yield "another dtype", c, idx, (src.double(), src)
    yield "another row shape", c, idx, (torch.ones(2, H, D // 2), src)
    yield "more rows than slots", c, idx, (torch.ones(3, H, D), torch.ones(3, H, D))
    yield "fewer sources than caches", c, idx, (src,)
    yield "a negative-bit source", c, idx, (src._neg_view(), src)
    yield "a list of slots", c, [1, 2], (src, src)
    yield "float slots", c, idx.float(), (src, src)
    base = torch.zeros(8, H, D)
    yield "caches that overlap", (base[:6], base[2:]), idx, (src, src)
    yield "nothing", (), idx, ()


@pytest.mark.parametrize("name,cs,idx,src", list(odd_calls()), ids=[c[0] for c in odd_calls()])
def test_scatter_rows_leaves_what_it_does_not_take_to_torch(name, cs, idx, src):
    assert scatter_rows(cs, idx, src) == -1
    assert untouched(cs)


@NEEDS_EXCHANGE_API
def test_scatter_rows_refuses_an_out_of_range_slot_before_writing():
    c = caches()
    with pytest.raises(IndexError, match=r"slot 6 \(index 2\) is out of range: valid slots are \[0, 6\)"):
        scatter_rows(c, torch.tensor([0, 1, 6]), (torch.ones(3, H, D), torch.ones(3, H, D)))
    assert untouched(c)


@NEEDS_EXCHANGE_API
def test_a_source_that_is_a_view_of_the_cache_is_stored_as_it_was():
    cache = torch.arange(6 * H * D, dtype=torch.float32).reshape(6, H, D)
    want = cache.clone()
    want[[1, 2]] = cache[[0, 1]].clone()
    assert scatter_into((cache,), torch.tensor([1, 2]), (cache[0:2],))
    assert torch.equal(cache, want)


@NEEDS_EXCHANGE_API
def test_scatter_into_counts_padding_out_and_takes_int32_numpy_made_slots():
    c = caches()
    slots = torch.from_numpy(np.array([5, -3, 0], dtype=np.int32))
    assert scatter_rows(c, slots, (torch.ones(3, H, D), torch.full((3, H, D), 2.0))) == 2
    assert c[0][[0, 5]].eq(1).all() and c[1][[0, 5]].eq(2).all()
    assert not c[0][1:5].any()
