"""Triton kernels compiled for a real GPU vs the torch reference (skipped without CUDA).

Same cases as the interpreter suite plus conversions the interpreter cannot do
(bf16 math, rounding fp32 -> fp8/bf16): on a GPU both sides round to nearest."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import kvpool.kernels as K  # noqa: E402
from kvpool.kernels import _ref  # noqa: E402

from kvpool.testing.kernel_cases import build_store, clone_opt, same, store_cases, untouched_equal  # noqa: E402

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(case=store_cases(max_n=40), seed=st.integers(0, 2**31 - 1))
def test_store_cuda(case, seed):
    kc, vc, slots, k, v, ks, vs = build_store(case, seed, device="cuda")
    rk, rv = kc.clone(), clone_opt(vc)
    kc0 = kc.clone()
    _ref.store_kv_ref(rk, rv, slots, k, v, ks, vs)
    K.store_kv(kc, vc, slots, k, v, ks, vs)
    assert same(kc.cpu(), rk.cpu()) and untouched_equal(kc0.cpu(), kc.cpu(), case.slots)
    if vc is not None:
        assert same(vc.cpu(), rv.cpu())


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_store_rounding_matches_torch(src_dtype, cache_dtype):
    kc = torch.zeros((64, 4, 96), dtype=cache_dtype, device="cuda")
    k = torch.randn((50, 4, 96), device="cuda").to(src_dtype) * 30
    slots = torch.randperm(64, device="cuda")[:50]
    ref = kc.clone()
    scale = torch.tensor([0.37], device="cuda") if cache_dtype == torch.float8_e4m3fn else None
    _ref.store_kv_ref(ref, None, slots, k, None, scale)
    K.store_kv(kc, None, slots, k, None, scale)
    assert same(kc.cpu(), ref.cpu())


def test_gather_copy_req_table_cuda():
    gen = torch.Generator().manual_seed(3)
    caches = [torch.randn((128, 4, 8, 64), generator=gen).half().cuda() for _ in range(6)]
    src = torch.tensor([4, 9, -1, 130], device="cuda")
    dst = torch.tensor([200, 201, 202, -1], device="cuda")
    ref = [t.clone() for t in caches]
    _ref.copy_slots_ref(ref, src, dst)
    K.copy_slots(caches, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(caches, ref))
    k, v = K.gather_kv(caches[0], caches[1], torch.tensor([200, -1, 7], device="cuda"))
    rk, rv = _ref.gather_kv_ref(caches[0], caches[1], torch.tensor([200, -1, 7], device="cuda"))
    assert torch.equal(k, rk) and torch.equal(v, rv)
    table = torch.zeros((8, 64), dtype=torch.int32, device="cuda")
    t = lambda xs: torch.tensor(xs, device="cuda")  # noqa: E731
    K.write_req_to_token(table, t([2, 5]), t([0, 10]), t([3, 2]), t([11, 12, 13, 14, 15]))
    assert table[2, :3].tolist() == [11, 12, 13] and table[5, 10:12].tolist() == [14, 15]
    assert int(table.ne(0).sum()) == 5
