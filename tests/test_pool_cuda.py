"""KVPool on a CUDA device: table mirror, kernel-backed writes, fp8, no host read-back.

Skipped without a GPU. On CPU the same device-path host logic is covered by
tests/test_pool_tables.py (forced device branch on CPU tensors).
"""

from __future__ import annotations

import pytest
import torch

import kvpool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

H, D = 2, 64


@pytest.mark.parametrize("layout", ["token", "paged"])
@pytest.mark.parametrize("built", ["default", "inference_mode"])
def test_cuda_extend_write_read(layout: str, built: str) -> None:
    ctx = torch.inference_mode() if built == "inference_mode" else torch.no_grad()
    with ctx:
        pool = kvpool.KVPool(2, H, D, dtype=torch.bfloat16, device="cuda", page_size=16, num_pages=64,
                             layout=layout, max_requests=8, max_context_len=256)
    assert pool.device.index is not None
    handles = pool.open(4)
    res = pool.extend(handles, [17, 1, 40, 3])
    assert res.out_cache_loc.is_cuda and res.out_cache_loc.dtype == torch.int64
    # A fresh pool hands out pages 1, 2, 3, ... in request order (page 0 reserved).
    expect = list(range(16, 33)) + [48] + list(range(64, 104)) + list(range(112, 115))
    assert res.out_cache_loc.cpu().tolist() == expect and res.slots.tolist() == expect
    table = pool.req_to_token.cpu()
    for h in handles:
        n = pool.allocator.length(h)
        assert table[int(pool.rows(h)[0]), :n].tolist() == pool.allocator.slots(h).tolist()
    assert not table[pool.null_row].any()
    k = torch.randn(len(res.slots), H, D, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        pool.write(1, res.out_cache_loc, k, -k)
    kr, vr = pool.read(1, res.slots)
    assert torch.equal(kr, k) and torch.equal(vr, -k)
    # Padding: -1 skipped, host slots accepted.
    pool.write(0, torch.tensor([-1] + res.slots[:2].tolist()), k[:3], k[:3])
    assert torch.equal(pool.read(0, res.slots[:2])[0], k[1:3])
    for _, t in pool.named_tensors():
        assert not t.is_inference() and not t.requires_grad and t.is_cuda
    pt = pool.page_table(handles)
    assert all(t.is_cuda and t.dtype == torch.int32 for t in pt)
    assert pt.kv_indptr.cpu().tolist() == [0, 2, 3, 6, 7]
    assert pt.kv_indices.cpu().tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert pt.kv_last_page_len.cpu().tolist() == [1, 1, 8, 3]


def test_cuda_fp8_roundtrip() -> None:
    pool = kvpool.KVPool(1, H, D, dtype=torch.float8_e4m3fn, device="cuda", num_slots=256,
                         max_requests=2, max_context_len=64)
    assert pool.k_scale is not None
    pool.k_scale.fill_(0.5)
    res = pool.extend(pool.open(1), 4)
    k = torch.tensor([1.0, 2.0, -4.0, 8.0], device="cuda").view(4, 1, 1).expand(4, H, D).bfloat16().contiguous()
    pool.write(0, res.out_cache_loc, k, k)
    kr, vr = pool.read(0, res.slots)
    assert torch.equal(kr, k) and torch.equal(vr, k)


def test_cuda_memory_fraction_sizes_the_pool() -> None:
    free, _ = torch.cuda.mem_get_info()
    # What torch's cache holds unused counts as free too (the pool's tensors reuse it).
    st = torch.cuda.memory_stats()
    free += max(st.get("reserved_bytes.all.current", 0) - st.get("allocated_bytes.all.current", 0)
                - st.get("inactive_split_bytes.all.current", 0), 0)
    pool = kvpool.KVPool(1, 1, 8, device="cuda", memory_fraction=0.001, max_requests=2, max_context_len=16)
    assert pool.nbytes + pool.req_to_token.nbytes <= int(free * 0.001)
    assert pool.nbytes > int(free * 0.001) - pool.req_to_token.nbytes - pool.bytes_per_slot
