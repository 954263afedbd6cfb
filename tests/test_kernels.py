"""kvpool.kernels in the normal session: the torch reference (the interpreter tests'
oracle) against naive per-row loops, the CPU path of the wrappers, and argument
validation (typed errors, nothing written). The Triton kernels themselves run in
test_kernels_interp.py (interpreter) and test_kernels_cuda.py (GPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpool
import kvpool.kernels as K
from kvpool.kernels import _ref
from kvpool.testing.kernel_cases import FP8, build_store, same, store_cases

# torch.float8_e8m0fnu is 2.7+ (pyproject's floor is 2.4): cased only where torch has it
E8M0 = [torch.float8_e8m0fnu] if hasattr(torch, "float8_e8m0fnu") else []


def naive_slot_view(cache: torch.Tensor, s: int) -> torch.Tensor:
    if cache.dim() == 3:
        return cache[s]
    p = cache.shape[1]
    return cache[s // p, s % p]


@settings(max_examples=60, deadline=None)
@given(case=store_cases(), seed=st.integers(0, 2**31 - 1))
def test_reference_store_is_a_per_row_write(case, seed):
    kc, vc, slots, k, v, ks, vs = build_store(case, seed)
    expect_k = kc.clone()
    for i, s in enumerate(case.slots):
        if s < 0:
            continue
        x = k[i].float() / (float(ks) if ks is not None else 1.0)
        if case.cache_dtype == FP8:
            x = x.clamp(-448.0, 448.0)
        naive_slot_view(expect_k, s).copy_(x.to(case.cache_dtype))
    _ref.store_kv_ref(kc, vc, slots, k, v, ks, vs)
    assert same(kc, expect_k)


@settings(max_examples=40, deadline=None)
@given(case=store_cases(), seed=st.integers(0, 2**31 - 1))
def test_reference_gather_and_cpu_wrapper(case, seed):
    kc, vc, slots, _, _, _, _ = build_store(case, seed)
    k, v = K.gather_kv(kc, vc, slots)
    for i, s in enumerate(case.slots):
        want = naive_slot_view(kc, s) if s >= 0 else torch.zeros_like(k[i])
        assert same(k[i], want)


def test_reference_copy_and_table():
    caches = [torch.arange(24.0).reshape(6, 1, 4) + 100 * i for i in range(3)]
    K.copy_slots(caches, torch.tensor([1, -1, 2]), torch.tensor([4, 5, -1]))
    for i, c in enumerate(caches):
        assert c[4].tolist() == (torch.arange(4.0, 8.0) + 100 * i).view(1, 4).tolist()
        assert c[5].tolist() == (torch.arange(20.0, 24.0) + 100 * i).view(1, 4).tolist()
    table = torch.zeros((4, 8), dtype=torch.int32)
    K.write_req_to_token(table, torch.tensor([3, -1, 1]), torch.tensor([1, 0, 6]),
                         torch.tensor([2, 1, 2]), torch.tensor([7, 8, 9, 10, 11]))
    assert table[3].tolist() == [0, 7, 8, 0, 0, 0, 0, 0]
    assert table[1].tolist() == [0, 0, 0, 0, 0, 0, 10, 11]  # request 1 (row -1) skipped its slot 9
    assert table[[0, 2]].eq(0).all()


def test_empty_calls_are_noops():
    kc = torch.randn(4, 2, 3)
    before = kc.clone()
    K.store_kv(kc, None, torch.empty(0, dtype=torch.int64), torch.empty(0, 2, 3), None)
    K.copy_slots([kc], torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    k, v = K.gather_kv(kc, None, torch.empty(0, dtype=torch.int32))
    assert k.shape == (0, 2, 3) and v is None and torch.equal(kc, before)


def _cache():
    return torch.randn(8, 2, 4), torch.randn(8, 2, 4)


@pytest.mark.parametrize(
    "call,err,match",
    [
        (lambda kc, vc: K.store_kv(kc, vc, torch.tensor([1]), torch.ones(1, 2, 5), torch.ones(1, 2, 5)),
         kvpool.TensorShapeError, r"k must have shape \[n, 2, 4\]"),
        (lambda kc, vc: K.store_kv(kc, vc, torch.tensor([1.0]), torch.ones(1, 2, 4), torch.ones(1, 2, 4)),
         kvpool.TensorDtypeError, "slots must be int32 or int64"),
        (lambda kc, vc: K.store_kv(kc, vc, torch.tensor([1, 2]), torch.ones(1, 2, 4), torch.ones(1, 2, 4)),
         kvpool.TensorShapeError, "slots has 2 entries, expected 1"),
        (lambda kc, vc: K.store_kv(kc, None, torch.tensor([1]), torch.ones(1, 2, 4), torch.ones(1, 2, 4)),
         K.KernelArgumentError, "both be given or both be None"),
        (lambda kc, vc: K.store_kv(kc, vc, torch.tensor([1]), torch.ones(1, 2, 4), torch.ones(2, 2, 4)),
         kvpool.TensorShapeError, "v has 2 rows, k has 1"),
        (lambda kc, vc: K.store_kv(kc.view(8, 8), vc, torch.tensor([1]), torch.ones(1, 2, 4), None),
         kvpool.TensorShapeError, r"k_cache must be \[num_slots, H, D\]"),
        (lambda kc, vc: K.store_kv(kc.int(), None, torch.tensor([1]), torch.ones(1, 2, 4), None),
         kvpool.TensorDtypeError, "k_cache has dtype torch.int32"),
        (lambda kc, vc: K.store_kv(kc, None, torch.tensor([1]), torch.ones(1, 2, 4), None, k_scale=0.0),
         K.KernelArgumentError, "k_scale must be > 0"),
        (lambda kc, vc: K.store_kv(kc, None, torch.tensor([1]), torch.ones(1, 2, 4), None,
                                   k_scale=torch.ones(2)),
         K.KernelArgumentError, "1-element tensor"),
        (lambda kc, vc: K.copy_slots([], torch.tensor([1]), torch.tensor([2])),
         K.KernelArgumentError, "non-empty list"),
        (lambda kc, vc: K.copy_slots([kc, torch.zeros(9, 2, 4)], torch.tensor([1]), torch.tensor([2])),
         K.KernelArgumentError, "caches\\[1\\] has 9 slots"),
        (lambda kc, vc: K.gather_kv(kc, vc, torch.tensor([1]), out=(torch.empty(2, 2, 4), None)),
         K.KernelArgumentError, "out\\[0\\] must be"),
        (lambda kc, vc: K.gather_kv(kc, vc, torch.tensor([1]), out_dtype=torch.int32),
         kvpool.TensorDtypeError, "out_dtype must be a cache dtype or torch.float64 .*, got torch.int32"),
        (lambda kc, vc: K.gather_kv(kc, None, torch.tensor([1]), out_dtype=torch.complex64),
         kvpool.TensorDtypeError, "out_dtype must be a cache dtype or torch.float64"),
        (lambda kc, vc: K.gather_kv(kc, None, torch.tensor([1]), out_dtype="float16"),
         kvpool.TensorDtypeError, "out_dtype must be a cache dtype or torch.float64 .*, got 'float16'"),
        # fp8 formats no cache takes: the interpreter's casts to the fnuz ones rounded wrong,
        # and it had no cast to e8m0, where torch's path converted them
        *[(lambda kc, vc, dt=dt: K.gather_kv(kc, None, torch.tensor([1]), out_dtype=dt),
           kvpool.TensorDtypeError, f"out_dtype must be a cache dtype .*, got {dt}")
          for dt in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, *E8M0)],
        # a meta tensor passed every check, then failed untyped (Tensor.item()) in the store
        (lambda kc, vc: K.store_kv(kc.to("meta"), None, torch.tensor([1], device="meta"),
                                   torch.ones(1, 2, 4, device="meta"), None),
         kvpool.TensorDeviceError, "k_cache is on meta; the kernels run on CPU or CUDA tensors"),
        (lambda kc, vc: K.gather_kv(kc, vc.to("meta"), torch.tensor([1])),
         kvpool.TensorDeviceError, "v_cache is on meta"),
        (lambda kc, vc: K.copy_slots([kc.to("meta")], torch.tensor([1]), torch.tensor([2])),
         kvpool.TensorDeviceError, r"caches\[0\] is on meta"),
        (lambda kc, vc: K.write_req_to_token(torch.zeros(4, 8, dtype=torch.int32).t(), torch.tensor([0]),
                                             torch.tensor([0]), torch.tensor([1]), torch.tensor([5])),
         K.KernelArgumentError, "contiguous rows"),
        (lambda kc, vc: K.write_req_to_token(torch.zeros(4, 8, dtype=torch.int32), torch.tensor([0, 1]),
                                             torch.tensor([0]), torch.tensor([1, 1]), torch.tensor([5, 6])),
         kvpool.TensorShapeError, "starts has 1 entries, expected 2"),
        # offsets other than the counts' prefix sum: the interpreter read past slots with them
        (lambda kc, vc: K.write_req_to_token(torch.zeros(4, 8, dtype=torch.int32), torch.tensor([0, 2]),
                                             torch.tensor([1, 6]), torch.tensor([3, 2]), torch.arange(100, 105),
                                             offsets=torch.tensor([2, 0])),
         K.KernelArgumentError, r"offsets\[0\] = 2, but offsets must be the exclusive prefix sum"),
        (lambda kc, vc: K.write_req_to_token(torch.zeros(4, 8, dtype=torch.int32), torch.tensor([0, 2]),
                                             torch.tensor([1, 6]), torch.tensor([-1, 2]), torch.arange(100, 105),
                                             offsets=torch.tensor([0, 1000])),
         K.KernelArgumentError, r"offsets\[1\] = 1000, .*: 0 there"),
        (lambda kc, vc: K.store_kv(kc, vc[:1].expand(vc.shape), torch.tensor([1]), torch.ones(1, 2, 4),
                                   torch.ones(1, 2, 4)),
         K.KernelArgumentError, "v_cache has overlapping elements"),
        (lambda kc, vc: K.copy_slots([kc, vc[:, :1].expand(vc.shape)], torch.tensor([1]), torch.tensor([2])),
         K.KernelArgumentError, r"caches\[1\] has overlapping elements"),
        (lambda kc, vc: K.write_req_to_token(torch.zeros(4, 8, dtype=torch.int32), torch.tensor([0]),
                                             torch.tensor([1]), torch.tensor([2]), torch.tensor([5, 2**31])),
         K.KernelArgumentError, r"slots\[1\] = 2147483648 does not fit the int32 req_to_token"),
        *[(lambda kc, vc, t=t: K.store_kv(kc, None, torch.tensor([1]), torch.ones(1, 2, 4), None, k_scale=t),
           K.KernelArgumentError, f"k_scale is a tensor of {t.dtype}")
          for t in (torch.tensor([True]), torch.tensor([2]), torch.tensor([2 + 0j]))],
    ],
)
def test_bad_arguments_raise_typed_errors_and_write_nothing(call, err, match):
    kc, vc = _cache()
    before = (kc.clone(), vc.clone())
    with pytest.raises(err, match=match):
        call(kc, vc)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    assert issubclass(err, kvpool.InvalidArgumentError) and issubclass(err, ValueError)


@pytest.mark.parametrize("dtype", [FP8, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "tensor"])
def test_reference_quantize_is_ieee_float32_division(dtype, as_tensor):
    """The kernel computes div_rn(x, float32(scale)); the reference must too, for a Python
    float scale as much as a tensor one (torch on CUDA would multiply by 1/scale)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn((4096,), generator=gen) * 50
    for s in (0.37, 0.1, 1 / 3, 3.0, 7e-3):
        s32 = float(torch.tensor(s, dtype=torch.float32))
        exact = (x.double() / s32).float()  # correctly rounded: double rounding is safe for /
        if dtype == FP8:
            exact = exact.clamp(-448.0, 448.0)
        scale = torch.tensor([s]) if as_tensor else s
        got = _ref.quantize(x, dtype, scale)
        assert same(got, exact.to(dtype)), f"scale {s}"
        assert got.device == x.device


def test_reference_divides_by_a_device_tensor_not_a_host_scalar(monkeypatch):
    """What makes the CUDA reference exact: the divisor reaching torch is a float32 tensor
    on x's device, never a Python float (a host scalar takes torch's reciprocal path)."""
    seen = []
    real = torch.Tensor.__truediv__

    def spy(a, b):
        seen.append(b)
        return real(a, b)

    monkeypatch.setattr(torch.Tensor, "__truediv__", spy)
    _ref.quantize(torch.ones(3, 2), FP8, 0.37)
    _ref.quantize(torch.ones(3, 2), torch.bfloat16, 0.37)
    assert len(seen) == 2
    assert all(isinstance(b, torch.Tensor) and b.dtype == torch.float32 and b.dim() == 1 for b in seen)


@pytest.mark.parametrize("with_v", [True, False])
def test_gather_kv_fills_and_returns_out_on_cpu(with_v):
    """out= is the capture-safe form: the rows land in the caller's tensors,
    and those very tensors come back (no fresh allocation)."""
    from kvpool.kernels import gather_kv

    k_cache = torch.arange(6 * 2 * 3, dtype=torch.float32).view(6, 2, 3)
    v_cache = -k_cache if with_v else None
    slots = torch.tensor([4, -1, 1])
    k_out = torch.full((3, 2, 3), 99.0)
    v_out = torch.full((3, 2, 3), 99.0) if with_v else None
    k, v = gather_kv(k_cache, v_cache, slots, out=(k_out, v_out))
    assert k is k_out
    expect = torch.stack([k_cache[4], torch.zeros(2, 3), k_cache[1]])
    assert torch.equal(k_out, expect)
    if with_v:
        assert v is v_out and torch.equal(v_out, -expect + 0.0)
    else:
        assert v is None


def test_kernels_and_cpu_pool_work_without_triton():
    """kvpool.kernels imports Triton only inside CUDA launches: with `import triton`
    failing, the package imports and a CPU pool extends, writes and reads."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kvpool, kvpool.kernels\n"
        "p = kvpool.KVPool(1, 2, 8, num_pages=8, max_requests=2, max_context_len=8)\n"
        "h = p.open(2); r = p.extend(h, [2, 1])\n"
        "k = torch.ones(3, 2, 8, dtype=torch.float16)\n"
        "p.write(0, r.out_cache_loc, k, 2 * k)\n"
        "a, b = p.read(0, r.out_cache_loc)\n"
        "assert torch.equal(a, k) and torch.equal(b, 2 * k)\n"
        "assert not [m for m in sys.modules if m.startswith('triton') and sys.modules[m] is not None]\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_cuda_without_triton_is_a_clear_error(monkeypatch):
    """No silent torch fallback on CUDA (it would write padding slots into slot 0):
    a missing Triton is a TritonUnavailableError that says what to install."""
    from kvpool.kernels import _common

    monkeypatch.setattr(_common, "_triton_checked", True)
    monkeypatch.setattr(_common, "_triton_error", ImportError("No module named 'triton'"))
    with pytest.raises(kvpool.TritonUnavailableError, match="pip install triton") as e:
        K.require_triton(torch.device("cuda", 0))
    assert isinstance(e.value, kvpool.KVPoolError) and isinstance(e.value, RuntimeError)
    K.require_triton(torch.device("cpu"))  # CPU never needs it
    assert not _common.use_triton(torch.zeros(1))
