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


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("scale", [0.37, 0.1, 1 / 3, 7e-3])
def test_store_float_scale_matches_reference(cache_dtype, scale):
    """A Python-float scale: the reference must divide like the kernel's div_rn (torch
    would multiply by 1/scale for a host scalar on CUDA, 1 ulp off)."""
    kc = torch.zeros((4096, 4, 96), dtype=cache_dtype, device="cuda")
    k = torch.randn((4000, 4, 96), device="cuda") * 40
    slots = torch.randperm(4096, device="cuda")[:4000]
    ref = kc.clone()
    _ref.store_kv_ref(ref, None, slots, k, None, scale)
    K.store_kv(kc, None, slots, k, None, scale)
    assert same(kc.cpu(), ref.cpu())


@pytest.mark.parametrize("heads,dim", [(8, 128), (8, 64), (1, 128), (1, 576), (8, 72)])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_row_shapes_cuda(heads, dim, cache_dtype):
    """The tile shapes of the codegen test, compiled and run: store, gather, copy."""
    gen = torch.Generator().manual_seed(heads * 1000 + dim)
    kc = torch.randn((512, heads, dim), generator=gen).to(cache_dtype).cuda()
    vc = torch.randn((512, heads, dim), generator=gen).to(cache_dtype).cuda()
    slots = torch.tensor([5, -1, 17, 2, 9, 300, -1], device="cuda")
    k = torch.randn((7, heads, dim), generator=gen).cuda().to(torch.bfloat16)
    scale = torch.tensor([0.5], device="cuda") if cache_dtype == torch.float8_e4m3fn else None
    rk, rv = kc.clone(), vc.clone()
    _ref.store_kv_ref(rk, rv, slots, k, k * 2, scale, scale)
    K.store_kv(kc, vc, slots, k, k * 2, scale, scale)
    assert same(kc.cpu(), rk.cpu()) and same(vc.cpu(), rv.cpu())
    probe = torch.tensor([17, -1, 5, 300, 0], device="cuda")
    got, want = K.gather_kv(kc, vc, probe), _ref.gather_kv_ref(kc, vc, probe)
    assert same(got[0].cpu(), want[0].cpu()) and same(got[1].cpu(), want[1].cpu())
    src, dst = torch.tensor([17, 5, -1, 9, 2], device="cuda"), torch.tensor([1, 3, 4, -1, 400], device="cuda")
    ref = [kc.clone(), vc.clone()]
    _ref.copy_slots_ref(ref, src, dst)
    K.copy_slots([kc, vc], src, dst)
    assert all(same(a.cpu(), b.cpu()) for a, b in zip([kc, vc], ref))


def test_evicted_copy_table_outlives_a_copy_queued_on_another_stream(monkeypatch):
    """copy_slots' offsets table built on the default stream, read by a copy queued
    behind ~50 ms of work on a side stream, then evicted while that copy waits. The
    default stream's next allocations must not get its memory: zeros there would turn
    every cache's offset into caches[0]'s, and caches 1-3 would not be copied."""
    from kvpool.kernels import copy as copy_mod
    from kvpool.kernels.copy_tables import OffsetTables

    monkeypatch.setattr(copy_mod, "TABLES", OffsetTables(capacity=1))
    caches = [torch.zeros((64, 2, 64), dtype=torch.float16, device="cuda") for _ in range(4)]
    for i, c in enumerate(caches):
        c[3] = i + 1
    src, dst = torch.tensor([3], device="cuda"), torch.tensor([40], device="cuda")
    K.copy_slots(caches, src, dst)             # builds the table on the default stream
    for c in caches:
        c[40] = 0
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        K.copy_slots(caches, src, dst)
    other = [torch.zeros((8, 2, 64), dtype=torch.float16, device="cuda")]
    K.copy_slots(other, torch.tensor([1], device="cuda"), torch.tensor([2], device="cuda"))  # evicts
    junk = [torch.zeros(64, dtype=torch.int64, device="cuda") for _ in range(32)]  # noqa: F841
    torch.cuda.synchronize()
    assert [float(c[40].float().mean()) for c in caches] == [1.0, 2.0, 3.0, 4.0]


def test_rows_that_are_negative_bit_views_are_stored_with_their_sign():
    """``z.conj().imag`` holds -imag in memory (torch's negative bit): the kernel stored that."""
    z = torch.complex(torch.zeros(2, 1, 8, device="cuda"), torch.arange(1.0, 17.0, device="cuda").view(2, 1, 8))
    k = z.conj().imag
    kc = torch.zeros(8, 1, 8, device="cuda")
    K.store_kv(kc, None, torch.tensor([3, 5], device="cuda"), k)
    assert torch.equal(kc[[3, 5]].cpu(), k.resolve_neg().cpu())


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_store_keeps_nan_and_saturates_the_rest(fp8):
    """Into fp8 a store clamps to the finite range: past it and +-inf saturate, NaN stays NaN,
    as torch's clamp does (the kernel asks min/max to propagate NaN; by default they return
    the non-NaN operand, -max). GPU only: the interpreter's own float -> fp8 conversion maps
    NaN to 384 and 500 to 256 (Triton 3.2 and 3.9), so it cannot check this."""
    m = 448.0 if fp8 == torch.float8_e4m3fn else 57344.0
    row = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e6, -1e6, 1.5, -0.0, m])
    rows = row.repeat(32).reshape(1, 1, 256).cuda()
    kc = torch.zeros(4, 1, 256, dtype=torch.uint8, device="cuda").view(fp8)
    vc = torch.zeros_like(kc)
    K.store_kv(kc, vc, torch.tensor([2], device="cuda"), rows, -rows)
    got, gotv = kc[2, 0, :8].float().cpu(), vc[2, 0, :8].float().cpu()
    assert torch.isnan(got[0]) and torch.isnan(gotv[0]), "NaN stays NaN"
    assert got[1:].tolist() == [m, -m, m, -m, 1.5, -0.0, m]
    assert gotv[1:].tolist() == [-m, m, -m, m, -1.5, 0.0, -m]
    want = _ref.quantize(rows, fp8, 1.0).float().cpu()
    assert torch.equal(torch.isnan(kc[2:3].float().cpu()), torch.isnan(want))
    assert torch.equal(kc[2:3].float().cpu().nan_to_num(7.0), want.nan_to_num(7.0))
