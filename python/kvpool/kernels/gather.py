"""gather_kv: read the K/V rows of given slots into contiguous [n, H, D] tensors
(reference attention, export, offload). Rows of negative slots come back zero.
Optionally dequantizes (x * scale, cast to out_dtype) in the same launch."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvpool.kernels import _common as c
from kvpool.kernels._ref import gather_kv_ref


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


def _check_out(out: Optional[torch.Tensor], name: str, n: int, g: c.CacheGeom, dtype, dev) -> None:
    if (
        not isinstance(out, torch.Tensor)
        or tuple(out.shape) != (n, g.heads, g.head_dim)
        or out.dtype != dtype
        or out.device != dev
        or not out.is_contiguous()
    ):
        raise c.KernelArgumentError(
            f"{name} must be a contiguous {dtype} tensor of shape [{n}, {g.heads}, {g.head_dim}] "
            f"on {dev}"
        )


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    slots: torch.Tensor,
    *,
    out_dtype: Optional[torch.dtype] = None,
    k_scale: c.Scale = None,
    v_scale: c.Scale = None,
    out: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Return (k, v): contiguous [n, H, D] copies of the rows at `slots` (v is None when
    v_cache is None). With a scale, rows are dequantized as x * scale into out_dtype
    (default: the cache dtype). Pass `out=(k_out, v_out)` to avoid allocating (e.g. in
    a captured graph)."""
    kg = c.cache_geom(k_cache, "k_cache")
    dev = k_cache.device
    c.check_index(slots, "slots", dev)
    n = slots.shape[0]
    # Without V the kernel gets K's tensors in V's place (never touched: HAS_V=False).
    vc, vg = k_cache, kg
    if v_cache is not None:
        vc, vg = v_cache, c.cache_geom(v_cache, "v_cache")
        # One PAGE for both caches in the kernel: a token-major V next to a paged K
        # (or different page sizes) would be addressed with K's page split.
        if (vg.heads, vg.head_dim, vg.num_slots, vg.page_size) != (
            kg.heads, kg.head_dim, kg.num_slots, kg.page_size
        ):
            raise c.KernelArgumentError(
                "k_cache and v_cache must have the same slots, page size and [H, D]"
            )
    has_v = v_cache is not None
    for s, nm in ((k_scale, "k_scale"), (v_scale, "v_scale")):
        c.check_scale(s, nm, dev)
    k_dt = out_dtype or k_cache.dtype
    v_dt = out_dtype or vc.dtype
    if out is None:
        k_out = torch.empty((n, kg.heads, kg.head_dim), dtype=k_dt, device=dev)
        v_out = torch.empty((n, kg.heads, kg.head_dim), dtype=v_dt, device=dev) if has_v else None
    else:
        k_out, v_out = out
        _check_out(k_out, "out[0]", n, kg, k_dt, dev)
        if has_v:
            _check_out(v_out, "out[1]", n, kg, v_dt, dev)
    vo = v_out if v_out is not None else k_out
    if n == 0:
        return k_out, v_out
    if not c.use_triton(k_cache):
        k_ref, v_ref = gather_kv_ref(k_cache, v_cache, slots, out_dtype, k_scale, v_scale)
        k_out.copy_(k_ref)
        if v_out is not None and v_ref is not None:
            v_out.copy_(v_ref)
        return k_out, v_out
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
    return k_out, v_out
