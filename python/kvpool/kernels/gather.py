"""Triton kernel of ``kvpool.kernels.gather_kv``: the K/V rows of given slots into
contiguous [n, H, D] tensors. Rows of negative slots come back zero. Optionally
dequantizes (x * scale, cast to out_dtype) in the same launch. Imported on the
first launch only."""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvpool.kernels import _common as c


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
    else:
        tl.store(out_ptr + out_off + hd_out, x.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _gather_kv_kernel(
    k_cache, v_cache, slots_ptr, k_out, v_out, k_scale, v_scale,
    n, H, D, PAGE,
    c_sp, c_so, c_sh, c_sd, vc_sp, vc_so, vc_sh, vc_sd,
    HAS_V: tl.constexpr, K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr,
    K_HAS_SCALE: tl.constexpr, V_HAS_SCALE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    hd_mask = (h < H) & (d < D)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    # Not hd_mask & (slot >= 0): the interpreter mistypes (tensor & scalar) bools.
    load_mask = (h < H) & (d < tl.where(slot >= 0, D, 0))
    page = slot // PAGE
    off = slot - page * PAGE
    out_off = t.to(tl.int64) * H * D  # outputs are contiguous [n, H, D]
    _gather_row(k_cache, k_out, page * c_sp + off * c_so, out_off, h * c_sh + d * c_sd,
                h * D + d, load_mask, hd_mask, k_scale, K_SCALE_PTR, K_HAS_SCALE)
    if HAS_V:
        _gather_row(v_cache, v_out, page * vc_sp + off * vc_so, out_off, h * vc_sh + d * vc_sd,
                    h * D + d, load_mask, hd_mask, v_scale, V_SCALE_PTR, V_HAS_SCALE)


def launch_gather_kv(
    k_cache: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, k_out: torch.Tensor, vo: torch.Tensor,
    kg: c.CacheGeom, vg: c.CacheGeom, has_v: bool, k_scale: c.Scale, v_scale: c.Scale,
) -> None:
    """One launch of the gather kernel; arguments validated by ``kvpool.kernels.gather_kv``
    (without V, ``vc``/``vo``/``vg`` are K's, never touched)."""
    n = slots.shape[0]
    ks, ks_ptr = c.scale_args(k_scale, k_out)
    vs, vs_ptr = c.scale_args(v_scale, vo)
    block_h, block_d, warps = c.tile(kg.heads, kg.head_dim)
    _gather_kv_kernel[(n, triton.cdiv(kg.heads, block_h))](
        k_cache, vc, slots, k_out, vo, ks, vs,
        n, kg.heads, kg.head_dim, kg.page_size,
        kg.stride_page, kg.stride_off, kg.stride_h, kg.stride_d,
        vg.stride_page, vg.stride_off, vg.stride_h, vg.stride_d,
        HAS_V=has_v, K_SCALE_PTR=ks_ptr, V_SCALE_PTR=vs_ptr,
        K_HAS_SCALE=k_scale is not None, V_HAS_SCALE=has_v and v_scale is not None,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=warps,
    )
