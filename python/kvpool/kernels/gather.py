"""Triton kernel of ``kvpool.kernels.gather_kv``: the K/V rows of given slots into
contiguous [n, H, D] tensors. Rows of negative slots come back zero. Optionally
dequantizes (x * scale, cast to out_dtype) in the same launch. Imported on the
first launch only."""

# No `from __future__ import annotations` here: Triton 3.0's interpreter (TRITON_INTERPRET=1)
# treats a parameter as constexpr only if its annotation is the tl.constexpr class, not a string
# (tests/test_review_dependency_floors.py).

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvpool.kernels import _common as c
from kvpool.kernels.launch import CompiledLaunch, Plan, launch_planned


@triton.jit
def _gather_row(
    cache_ptr, out_ptr, cache_off, out_off, hd_cache, hd_out, load_mask, store_mask,
    scale, SCALE_IS_PTR: tl.constexpr, HAS_SCALE: tl.constexpr,
):
    x = tl.load(cache_ptr + cache_off + hd_cache, mask=load_mask, other=0.0)
    if HAS_SCALE:
        if SCALE_IS_PTR:
            s = tl.load(scale).to(tl.float32)
        else:
            s = scale
        tl.store(out_ptr + out_off + hd_out, (x.to(tl.float32) * s).to(out_ptr.dtype.element_ty),
                 mask=store_mask)
    elif x.dtype != out_ptr.dtype.element_ty and x.dtype.is_fp8() and (
            out_ptr.dtype.element_ty.is_fp8() or out_ptr.dtype.element_ty.is_fp64()):
        # Through float32, which holds every fp8 value exactly: Triton has no direct cast from
        # one fp8 format to the other, nor from fp8 to float64. (Not for other pairs: a gather
        # in the cache's own dtype copies bits, NaN payloads, infinities and subnormals included;
        # on a GPU the way back from float32 saturates.)
        tl.store(out_ptr + out_off + hd_out, x.to(tl.float32).to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        tl.store(out_ptr + out_off + hd_out, x.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _gather_kv_kernel(
    k_cache, v_cache, slots_ptr, k_out, v_out, k_scale, v_scale,
    n, H, D, PAGE,
    c_sp, c_so, c_sh, c_sd, vc_sp, vc_so, vc_sh, vc_sd, slots_st,
    HAS_V: tl.constexpr, K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr,
    K_HAS_SCALE: tl.constexpr, V_HAS_SCALE: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr,
):
    # Tile [ROWS tokens, BLOCK_H heads, BLOCK_D dims]; ROWS > 1 only when one row is
    # too short to give every thread of a warp 16 bytes.
    # D and the strides are multiples of VEC (host-checked): see store.py.
    D = D // VEC * VEC
    c_sp, c_so, c_sh = c_sp // VEC * VEC, c_so // VEC * VEC, c_sh // VEC * VEC
    vc_sp, vc_so, vc_sh = vc_sp // VEC * VEC, vc_so // VEC * VEC, vc_sh // VEC * VEC
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)                  # [R]
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[None, :, None]  # [1, BH, 1]
    d = tl.arange(0, BLOCK_D)[None, None, :]                          # [1, 1, BD]
    slot = tl.load(slots_ptr + tl.minimum(t, n - 1).to(tl.int64) * slots_st).to(tl.int64)  # any 1-D view
    # Dim limits: D for real rows, 0 past n (store) and for padding slots (load, which
    # then reads zeros). Arithmetic keeps D's divisibility (store.py), and the
    # interpreter mistypes mixed-rank bool ands.
    store_lim = (D * (t < n).to(tl.int32))[:, None, None]
    load_lim = (D * ((t < n) & (slot >= 0)).to(tl.int32))[:, None, None]
    store_mask = (h < H) & (d < store_lim)
    load_mask = (h < H) & (d < load_lim)
    page = slot // PAGE
    off = slot - page * PAGE
    out_off = (t.to(tl.int64) * H * D)[:, None, None]  # outputs are contiguous [n, H, D]
    _gather_row(k_cache, k_out, (page * c_sp + off * c_so)[:, None, None], out_off, h * c_sh + d * c_sd,
                h * D + d, load_mask, store_mask, k_scale, K_SCALE_PTR, K_HAS_SCALE)
    if HAS_V:
        _gather_row(v_cache, v_out, (page * vc_sp + off * vc_so)[:, None, None], out_off,
                    h * vc_sh + d * vc_sd, h * D + d, load_mask, store_mask, v_scale, V_SCALE_PTR, V_HAS_SCALE)

_LAUNCH = CompiledLaunch(_gather_kv_kernel)
_PLANS: dict[tuple, Plan] = {}  # plan key -> plan (kvpool.kernels.launch)


def launch_gather_kv(
    k_cache: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, k_out: torch.Tensor, vo: torch.Tensor,
    kg: c.CacheGeom, vg: c.CacheGeom, has_v: bool, k_scale: c.Scale, v_scale: c.Scale,
) -> None:
    """One launch of the gather kernel; arguments validated by ``kvpool.kernels.gather_kv``
    (without V, ``vc``/``vo``/``vg`` are K's, never touched). As ``launch_store_kv``: the
    derived arguments are kept per plan key, which also holds what Triton specialises on."""
    n = slots.shape[0]
    ks, ks_ptr = c.scale_args(k_scale, k_out)
    vs, vs_ptr = c.scale_args(v_scale, vo)
    key = (kg, vg, has_v, k_cache.dtype, vc.dtype, k_out.dtype, vo.dtype, slots.dtype, slots.stride(0),
           k_scale is None, v_scale is None, ks.dtype if ks_ptr else None, vs.dtype if vs_ptr else None,
           n == 1, n % 16 == 0, n >= 1 << 31,
           k_cache.data_ptr() % 16 == 0, vc.data_ptr() % 16 == 0, slots.data_ptr() % 16 == 0,
           k_out.data_ptr() % 16 == 0, vo.data_ptr() % 16 == 0,
           ks.data_ptr() % 16 == 0 if ks_ptr else None, vs.data_ptr() % 16 == 0 if vs_ptr else None,
           k_cache.get_device())
    launch_planned(_LAUNCH, _gather_kv_kernel, _PLANS, key,
                   lambda: _plan(k_cache, vc, slots, k_out, vo, kg, vg, has_v, k_scale, v_scale),
                   (k_cache, vc, slots, k_out, vo, ks, vs), n, k_cache.is_cuda)


def _plan(k_cache: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, k_out: torch.Tensor, vo: torch.Tensor,
          kg: c.CacheGeom, vg: c.CacheGeom, has_v: bool, k_scale: c.Scale,
          v_scale: c.Scale) -> Plan:
    heads, dim = kg.heads, kg.head_dim
    strides = [[kg.stride_page, kg.stride_off, kg.stride_h, kg.stride_d],
               [vg.stride_page, vg.stride_off, vg.stride_h, vg.stride_d]]
    if c.contiguous_rows(heads, dim, [(x[2], x[3]) for x in strides]):  # outputs are contiguous
        heads, dim = 1, heads * dim
        for x in strides:
            x[2] = dim
    itemsize = min(t.element_size() for t in (k_cache, vc, k_out, vo))
    vec = c.vec_hint(dim, [s for x in strides for s in x[:3]], [x[3] for x in strides], itemsize)
    block_h, block_d, warps = c.tile(heads, dim, itemsize)
    rows = c.rows_to_fill_warp(block_h * block_d, itemsize)
    tail = (heads, dim, kg.page_size, *strides[0], *strides[1], slots.stride(0),
            has_v, isinstance(k_scale, torch.Tensor), isinstance(v_scale, torch.Tensor),  # HAS_V, K/V_SCALE_PTR
            k_scale is not None, has_v and v_scale is not None,  # K/V_HAS_SCALE
            rows, block_h, block_d, vec)
    return tail, rows, triton.cdiv(heads, block_h), warps
