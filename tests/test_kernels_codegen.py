"""What the Triton kernels compile to on a real GPU target, checked on a CPU machine.

Each kernel is compiled for Hopper (GPUTarget("cuda", 90, 32)) with Triton's own
compiler and the exact arguments its wrapper would launch with (tests/_codegen.py),
for fp16, bf16 and fp8 caches and the row shapes engines use: 8 KV heads x 128 and
x 64, 1 head x 128 (a tensor-parallel rank of a GQA model), MLA's 576-wide latent,
and head_dim 72 (not a multiple of 16). The PTX must show
- 16-byte global accesses (ld/st.global.v4.b32) for every K/V row access, fp8
  included: the tile gives each thread 16 bytes of the narrowest tensor, and rows
  whose heads are contiguous are moved as one run of H * D elements, so a head_dim
  of 72 is no obstacle. Nothing narrower than 4 bytes anywhere: a mask or stride the
  compiler cannot prove uniform over a thread's run makes it emit one ld/st per
  element (b16, or b8 for fp8), as Triton 3.9 did with store_kv's
  `tl.where(slot >= 0, D, 0)` row limit and with head_dim 72;
- 64-bit slot-offset arithmetic: slot ids are multiplied by strides in 64 bits and
  never truncated to 32, so caches past 2^31 elements are addressed correctly.
"""

from __future__ import annotations

import re

import _codegen as cg
import pytest
import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

REASON = cg.cuda_target_unavailable(90)
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

import kvpool.kernels as K  # noqa: E402
from kvpool.kernels import copy as copy_mod  # noqa: E402
from kvpool.kernels import gather as gather_mod  # noqa: E402
from kvpool.kernels import store as store_mod  # noqa: E402

FP8 = torch.float8_e4m3fn
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": FP8}
# (KV heads, head_dim) per row.
SHAPES = {"h8d128": (8, 128), "h8d64": (8, 64), "h1d128": (1, 128), "mla576": (1, 576), "h8d72": (8, 72)}


def _check_vectorised(ptx: str, width: int, loads: int, stores: int) -> None:
    """Every store, and every vector load, moves >= `width` bytes a thread; at least
    `loads` / `stores` such data accesses; nothing narrower than 4 bytes (the scalar
    loads left are slot ids and fp8 scales)."""
    acc = cg.global_accesses(ptx)
    narrow = {op: k for op, k in acc.items() if cg.access_bytes(op) < 4}
    assert not narrow, f"element-wise global accesses (the mask defeats vectorisation): {narrow}; all: {dict(acc)}"
    thin = {op: k for op, k in acc.items()
            if (op.startswith("st.global") or ".v" in op) and cg.access_bytes(op) < width}
    assert not thin, f"K/V accesses narrower than {width} bytes: {thin}; all: {dict(acc)}"
    for kind, want in (("ld", loads), ("st", stores)):
        got = sum(k for op, k in acc.items() if op.startswith(f"{kind}.global.v") and cg.access_bytes(op) >= width)
        assert got >= want, f"{kind}: want {want} accesses of >= {width} bytes, got {dict(acc)}"


def _check_64bit(ptx: str, runtime_params: list, name: str) -> None:
    i = runtime_params.index(name)
    assert cg.wide_slot_products(ptx, i), f"no 64-bit multiply of {name} values in the PTX"
    bad = cg.narrowed_slot_uses(ptx, i)
    assert not bad, f"{name} values narrowed to 32 bits: {bad}"


def _record(module, kernel_name, call):
    with cg.recording(module, kernel_name) as rec:
        call()
    assert len(rec.calls) == 1, f"expected one launch, got {len(rec.calls)}"
    return rec.fn, rec.calls[0]


def _caches(layout: str, shape, dtype):
    heads, dim = shape
    if layout == "token":
        return torch.zeros((8192, heads, dim), dtype=dtype), torch.zeros((8192, heads, dim), dtype=dtype)
    return torch.zeros((512, 16, heads, dim), dtype=dtype), torch.zeros((512, 16, heads, dim), dtype=dtype)


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize(
    "layout,n,slot_dtype",
    [("token", 1, torch.int64), ("paged", 7, torch.int32), ("token", 4096, torch.int64)],
    ids=["decode-token-i64", "decode-paged-i32", "prefill-token-i64"],
)
def test_store_kv_codegen(shape, dtype, layout, n, slot_dtype):
    cache_dt = DTYPES[dtype]
    in_dt = torch.bfloat16 if cache_dt == FP8 else cache_dt
    kc, vc = _caches(layout, SHAPES[shape], cache_dt)
    k, v = torch.zeros((n, *SHAPES[shape]), dtype=in_dt), torch.zeros((n, *SHAPES[shape]), dtype=in_dt)
    slots = torch.arange(n, dtype=slot_dtype)
    scale = torch.ones(1) if cache_dt == FP8 else None
    fn, launch = _record(store_mod, "_store_kv_kernel",
                         lambda: K.store_kv(kc, vc, slots, k, v, scale, scale))
    ptx, params = cg.compile_launch(fn, launch)
    _check_vectorised(ptx, 16, loads=2, stores=2)
    _check_64bit(ptx, params, "slots_ptr")


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_gather_kv_codegen(shape, dtype):
    cache_dt = DTYPES[dtype]
    kc, vc = _caches("paged", SHAPES[shape], cache_dt)
    slots = torch.arange(5)
    kw = {"out_dtype": torch.bfloat16, "k_scale": torch.ones(1), "v_scale": torch.ones(1)} if cache_dt == FP8 else {}
    fn, launch = _record(gather_mod, "_gather_kv_kernel", lambda: K.gather_kv(kc, vc, slots, **kw))
    ptx, params = cg.compile_launch(fn, launch)
    _check_vectorised(ptx, 16, loads=2, stores=2)
    _check_64bit(ptx, params, "slots_ptr")


@pytest.mark.parametrize("out_dt", [torch.float8_e5m2, torch.float64], ids=["e5m2", "f64"])
def test_gather_kv_codegen_converts_fp8_through_float32(out_dt):
    """An e4m3 cache gathered into the other fp8 format or float64 (through float32: Triton
    has no direct cast) compiles for Hopper."""
    kc, vc = _caches("paged", SHAPES[next(iter(SHAPES))], FP8)
    fn, launch = _record(gather_mod, "_gather_kv_kernel",
                         lambda: K.gather_kv(kc, vc, torch.arange(5), out_dtype=out_dt))
    ptx, _params = cg.compile_launch(fn, launch)
    assert "cvt" in ptx


@pytest.mark.parametrize("cache_dt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_gather_kv_codegen_copies_fp8_in_its_own_dtype(cache_dt):
    """An fp8 gather without a scale or out_dtype copies bits: no conversion (through float32 the
    way back saturates, turning e5m2 infinities into 57344 and NaN payloads into one NaN)."""
    kc, vc = _caches("paged", SHAPES[next(iter(SHAPES))], cache_dt)
    fn, launch = _record(gather_mod, "_gather_kv_kernel", lambda: K.gather_kv(kc, vc, torch.arange(5)))
    ptx, _params = cg.compile_launch(fn, launch)
    assert not re.findall(r"cvt\.[a-z0-9.]*(?:e4m3|e5m2)", ptx)


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_copy_slots_codegen(shape, dtype):
    caches = [t for _ in range(2) for t in _caches("paged", SHAPES[shape], DTYPES[dtype])]
    src, dst = torch.arange(3), torch.arange(3) + 100
    fn, launch = _record(copy_mod, "_copy_slots_kernel", lambda: K.copy_slots(caches, src, dst))
    ptx, params = cg.compile_launch(fn, launch)
    _check_vectorised(ptx, 16, loads=1, stores=1)
    _check_64bit(ptx, params, "src_ptr")
    _check_64bit(ptx, params, "dst_ptr")


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_store_kv_codegen_strided_heads(dtype):
    """head_dim 72 in a cache whose heads are 80 apart (a view, so rows are not one
    contiguous run): the kernel is told that D and the strides are multiples of 8
    elements. 16-bit rows then get 16-byte accesses; an fp8 head starts every 72
    bytes, so 8 bytes is the widest access its alignment allows."""
    cache_dt = DTYPES[dtype]
    in_dt = torch.bfloat16 if cache_dt == FP8 else cache_dt
    kc, vc = (torch.zeros((4096, 8, 80), dtype=cache_dt)[..., :72] for _ in range(2))
    k, v = torch.zeros((3, 8, 72), dtype=in_dt), torch.zeros((3, 8, 72), dtype=in_dt)
    scale = torch.ones(1) if cache_dt == FP8 else None
    fn, launch = _record(store_mod, "_store_kv_kernel",
                         lambda: K.store_kv(kc, vc, torch.arange(3), k, v, scale, scale))
    ptx, params = cg.compile_launch(fn, launch)
    _check_vectorised(ptx, 16 if cache_dt.itemsize >= 2 else 8, loads=2, stores=2)
    _check_64bit(ptx, params, "slots_ptr")


# ----- the checks themselves can fail ---------------------------------------------------

@triton.jit
def _offset_kernel(cache, slots, x, stride, WIDE: tl.constexpr):
    s = tl.load(slots + tl.program_id(0))  # int32 slot ids
    if WIDE:
        s = s.to(tl.int64)
    d = tl.arange(0, 128)
    tl.store(cache + s * stride + d, tl.load(x + d))


@triton.jit
def _where_mask_kernel(cache, slots, x, D):
    t = tl.program_id(0) * 4 + tl.arange(0, 4)
    s = tl.load(slots + t).to(tl.int64)
    d = tl.arange(0, 128)[None, :]
    lim = tl.where(s >= 0, D, 0)[:, None]  # the old store_kv row limit
    tl.store(cache + s[:, None] * 128 + d, tl.load(x + t[:, None] * 128 + d), mask=d < lim)


def test_analysis_flags_32bit_slot_offsets():
    args = (torch.zeros(4096, dtype=torch.float16), torch.arange(4, dtype=torch.int32),
            torch.zeros(128, dtype=torch.float16), 128)
    narrow_ptx, params = cg.compile_launch(_offset_kernel, ((4,), args, {"WIDE": False}))
    assert cg.narrowed_slot_uses(narrow_ptx, params.index("slots")), "int32 slot * stride not flagged"
    wide_ptx, params = cg.compile_launch(_offset_kernel, ((4,), args, {"WIDE": True}))
    assert not cg.narrowed_slot_uses(wide_ptx, params.index("slots"))
    assert cg.wide_slot_products(wide_ptx, params.index("slots"))


def test_analysis_flags_elementwise_access():
    """A per-row tl.where row limit: Triton 3.9 emits b16 accesses (the defect the store
    tests guard against). Older Triton vectorises it; then there is nothing to flag."""
    args = (torch.zeros(4096 * 128, dtype=torch.bfloat16), torch.arange(16),
            torch.zeros(16 * 128, dtype=torch.bfloat16), 128)
    ptx, _ = cg.compile_launch(_where_mask_kernel, ((4,), args, {"num_warps": 4}))
    acc = cg.global_accesses(ptx)
    if all(cg.access_bytes(op) >= 4 for op in acc):
        pytest.skip(f"triton {triton.__version__} vectorises the where-form mask: {dict(acc)}")
    with pytest.raises(AssertionError, match="element-wise"):
        _check_vectorised(ptx, 16, loads=1, stores=1)
