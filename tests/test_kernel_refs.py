"""The torch references (the CPU path of every kernel wrapper, and the oracle
the Triton kernels are tested against) checked against values worked out by
hand, so a bug shared by a kernel and its reference cannot hide: V goes to V's
cache, v_scale (not k_scale) scales V, fp8 saturates at +-448 and dequantising
multiplies the scale back."""

from __future__ import annotations

import pytest
import torch

from kvpool.kernels import _ref

F8 = torch.float8_e4m3fn


@pytest.mark.parametrize("paged", [False, True])
def test_store_ref_puts_k_and_v_in_their_own_caches(paged):
    shape = (4, 2, 1, 2) if paged else (8, 1, 2)  # 8 slots, H=1, D=2
    kc, vc = torch.zeros(shape), torch.zeros(shape)
    slots = torch.tensor([5, -1, 2])
    k = torch.tensor([[[1.0, 2.0]], [[7.0, 7.0]], [[3.0, 4.0]]])
    v = torch.tensor([[[-1.0, -2.0]], [[8.0, 8.0]], [[-3.0, -4.0]]])
    _ref.store_kv_ref(kc, vc, slots, k, v)
    kf, vf = kc.reshape(8, 2), vc.reshape(8, 2)
    expect_k, expect_v = torch.zeros(8, 2), torch.zeros(8, 2)
    expect_k[5], expect_k[2] = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    expect_v[5], expect_v[2] = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0])
    assert torch.equal(kf, expect_k) and torch.equal(vf, expect_v)  # padding row 1 skipped


def test_fp8_store_uses_each_caches_own_scale_and_saturates():
    kc, vc = torch.zeros(4, 1, 3, dtype=F8), torch.zeros(4, 1, 3, dtype=F8)
    k = torch.tensor([[[1.0, -2.0, 1000.0]]])
    v = torch.tensor([[[2.0, -896.0, 3.0]]])
    _ref.store_kv_ref(kc, vc, torch.tensor([3]), k, v, k_scale=0.5, v_scale=torch.tensor([2.0]))
    # k / 0.5 = [2, -4, 2000 -> 448]; v / 2 = [1, -448, 1.5]: all exact in e4m3.
    assert kc[3].float().flatten().tolist() == [2.0, -4.0, 448.0]
    assert vc[3].float().flatten().tolist() == [1.0, -448.0, 1.5]
    assert not kc[:3].float().any() and not vc[:3].float().any()


def test_dequantize_multiplies_the_scale_back():
    kc, vc = torch.zeros(4, 1, 3, dtype=F8), torch.zeros(4, 1, 3, dtype=F8)
    kc[1] = torch.tensor([[2.0, -4.0, 448.0]]).to(F8)
    vc[1] = torch.tensor([[1.0, -448.0, 1.5]]).to(F8)
    k, v = _ref.gather_kv_ref(kc, vc, torch.tensor([1, -1]), out_dtype=torch.float32,
                              k_scale=0.5, v_scale=torch.tensor([2.0]))
    assert k.tolist() == [[[1.0, -2.0, 224.0]], [[0.0, 0.0, 0.0]]]
    assert v.tolist() == [[[2.0, -896.0, 3.0]], [[0.0, 0.0, 0.0]]]
    assert _ref.dequantize(torch.tensor([3.0]), torch.bfloat16, 0.25).tolist() == [0.75]
    assert _ref.dequantize(torch.tensor([3.0]), torch.float32, None).tolist() == [3.0]


def test_quantize_non_fp8_with_scale_divides():
    assert _ref.quantize(torch.tensor([3.0]), torch.float16, 2.0).tolist() == [1.5]
    assert _ref.quantize(torch.tensor([3.0]), torch.float16, None).tolist() == [3.0]
