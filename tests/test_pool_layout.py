"""Layouts, MLA latent caches, fp8 storage, capacity and memory figures."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvpool
from kvpool.capacity import resolve_num_pages, table_bytes


def open_and_extend(pool: kvpool.KVPool, n: int) -> torch.Tensor:
    return pool.extend(pool.open(1), n).out_cache_loc


@pytest.mark.parametrize("page_size", [1, 4])
def test_token_and_paged_views_are_the_same_memory(page_size: int) -> None:
    kw: dict[str, Any] = dict(dtype=torch.float16, page_size=page_size, num_pages=8, max_requests=2,
                              max_context_len=16)
    tok = kvpool.KVPool(3, 2, 8, layout="token", **kw)
    pag = kvpool.KVPool(3, 2, 8, layout="paged", **kw)
    assert tok.k_buffer(1).shape == (8 * page_size, 2, 8)
    assert pag.k_buffer(1).shape == (8, page_size, 2, 8)
    for pool in (tok, pag):
        for layer in range(3):
            for buf, cache in ((pool.k_buffer(layer), 0), (pool.v_buffer(layer), 1)):
                # A view into the single [layers, slots, H, D] allocation, no copy.
                base = pool._storage.caches[cache]
                assert buf.data_ptr() == base[layer].data_ptr()
                assert buf.is_contiguous()
        assert pool.k_buffers[2].data_ptr() == pool.k_buffer(2).data_ptr()
    slots = open_and_extend(pag, 5)
    k = torch.randn(5, 2, 8).half()
    pag.write(2, slots, k, k * 2)
    k_read, v_read = pag.read(2, slots)
    assert torch.equal(k_read, k) and torch.equal(v_read, k * 2)
    assert torch.equal(pag.k_buffer(2).reshape(-1, 2, 8)[slots], k)


def test_negative_slots_are_skipped_and_read_as_zeros() -> None:
    pool = kvpool.KVPool(1, 1, 2, dtype=torch.float32, num_slots=8, max_requests=1, max_context_len=8)
    slots = open_and_extend(pool, 2)
    pool.write(0, torch.tensor([-1, int(slots[0]), -5, int(slots[1])], dtype=torch.int32),
               torch.full((4, 1, 2), 3.0), torch.full((4, 1, 2), 4.0))
    assert int((pool.k_buffer(0) != 0).any(dim=(1, 2)).sum()) == 2
    k, v = pool.read(0, [int(slots[0]), -1])
    assert k[0].eq(3).all() and k[1].eq(0).all() and v[0].eq(4).all()


def test_mla_latent_buffer_per_layer() -> None:
    pool = kvpool.KVPool(2, 1, 12, kv_lora_rank=8, qk_rope_head_dim=4, dtype=torch.bfloat16,
                         num_slots=16, max_requests=2, max_context_len=8)
    assert pool.mla and len(pool.named_tensors()) == 2  # one latent cache + req_to_token
    assert pool.kv_buffer(0).shape == (16, 1, 12)
    assert pool.bytes_per_slot == 2 * 12 * 2  # layers x latent width x bf16, no separate V
    assert pool.nbytes == 16 * pool.bytes_per_slot
    slots = open_and_extend(pool, 3)
    kv = torch.randn(3, 1, 12).bfloat16()
    pool.write(1, slots, kv)
    assert torch.equal(pool.kv_buffer(1)[slots], kv)
    # v_buffer: the first kv_lora_rank features of the latent, as a view.
    assert pool.v_buffer(1).shape == (16, 1, 8)
    assert pool.v_buffer(1).data_ptr() == pool.kv_buffer(1).data_ptr()
    k, v = pool.read(1, slots)
    assert torch.equal(k, kv) and torch.equal(v, kv[..., :8])
    with pytest.raises(kvpool.InvalidArgumentError, match="MLA"):
        kvpool.KVPool(1, 2, 4, num_slots=8).kv_buffer(0)


def test_mla_paged_layout() -> None:
    pool = kvpool.KVPool(1, 1, 6, kv_lora_rank=4, qk_rope_head_dim=2, page_size=4, num_pages=3,
                         layout="paged", max_requests=1, max_context_len=8)
    assert pool.kv_buffer(0).shape == (3, 4, 1, 6)


@pytest.mark.parametrize("layout", ["token", "paged"])
def test_fp8_writes_quantize_with_per_layer_scale_and_read_dequantizes(layout: str) -> None:
    pool = kvpool.KVPool(2, 2, 4, dtype=torch.float8_e4m3fn, num_slots=16, layout=layout,
                         max_requests=1, max_context_len=8)
    assert pool.compute_dtype == torch.bfloat16
    assert pool.k_scale is not None and pool.v_scale is not None
    assert pool.k_scale.dtype == torch.float32 and pool.k_scale.shape == (2,)
    pool.k_scale[1] = 2.0
    pool.v_scale[1] = 0.5
    slots = open_and_extend(pool, 3)
    k = torch.tensor([1.0, -3.0, 1000.0]).repeat_interleave(8).view(3, 2, 4).bfloat16()
    pool.write(1, slots, k, k)
    stored_k = pool.k_buffer(1).reshape(-1, 2, 4).view(torch.uint8)[slots].view(pool.dtype).float()  # bytes: torch 2.4
    # Stored = clamp(x / scale) in fp8: 1/2, -3/2 and 1000/2 -> clamped to 448.
    assert stored_k[:, 0, 0].tolist() == [0.5, -1.5, 448.0]
    k_read, v_read = pool.read(1, slots)
    assert k_read.dtype == torch.bfloat16
    assert k_read[:, 0, 0].tolist() == [1.0, -3.0, 896.0]
    assert v_read[:, 0, 0].tolist() == [1.0, -3.0, 224.0]  # 1000/0.5 saturates at 448 -> 224
    assert not pool.k_buffer(0).view(torch.uint8).any()  # layer 0 untouched


def test_capacity_from_pages_slots_bytes_and_fraction() -> None:
    kw: dict[str, Any] = dict(page_size=4, max_requests=8, max_context_len=64)
    base = kvpool.KVPool(2, 2, 8, num_pages=10, **kw)
    assert base.bytes_per_slot == 2 * 2 * 2 * 8 * 2  # layers x (K,V) x heads x dim x fp16
    assert base.num_slots == 40 and base.nbytes == 40 * base.bytes_per_slot
    assert kvpool.KVPool(2, 2, 8, num_slots=40, **kw).num_pages == 10
    fixed = table_bytes(8, 64)
    budget = fixed + 10 * 4 * base.bytes_per_slot + 100  # slack below one page is not used
    by_bytes = kvpool.KVPool(2, 2, 8, memory_bytes=budget, **kw)
    assert by_bytes.num_pages == 10
    assert by_bytes.nbytes + by_bytes.req_to_token.nbytes <= budget
    pages = resolve_num_pages(page_size=4, slot_bytes=100, fixed_bytes=1000, num_pages=None, num_slots=None,
                              memory_bytes=None, memory_fraction=0.5, device=torch.device("cpu"))
    assert pages >= 2  # half the host's available RAM holds many 400-byte pages


def test_memory_figures_and_overhead_is_small_at_scale() -> None:
    pool = kvpool.KVPool(1, 1, 8, dtype=torch.float16, num_slots=1 << 16, max_requests=8, max_context_len=128)
    assert pool.nbytes == (1 << 16) * pool.bytes_per_slot
    # req_to_token is a [9, 128] view of rows padded to 144 ints (9 lines,
    # odd): the padding is counted.
    expected = 9 * 144 * 4 + pool.allocator.metadata_bytes
    assert pool.overhead_bytes == expected
    assert pool.req_to_token.shape == (9, 128) and pool.null_row == 8
    assert pool.req_to_token.stride() == (144, 1)
    assert "overhead_bytes" in repr(pool)


def test_dtypes_stay_put_and_nothing_requires_grad() -> None:
    pool = kvpool.KVPool(1, 1, 4, dtype=torch.float32, num_slots=8, max_requests=1, max_context_len=4)
    slots = open_and_extend(pool, 2)
    w = torch.ones((), requires_grad=True)
    with torch.enable_grad():
        pool.write(0, slots, torch.ones(2, 1, 4) * w, torch.ones(2, 1, 4) * w)
    assert all(not t.requires_grad for _, t in pool.named_tensors())
    assert pool.req_to_token.dtype == torch.int32
