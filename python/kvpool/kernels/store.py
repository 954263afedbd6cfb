"""Triton kernel of ``kvpool.kernels.store_kv``: a step's K and V rows into a layer's caches.

Imported on the first launch only (CPU pools never load Triton).

One launch writes K and V together. The grid is (token groups, head blocks);
each program handles ROWS tokens and a [BLOCK_H, BLOCK_D] tile of heads x
head_dim, masked past H and D so head_dim need not be a power of two. Slot ids
are read on device; a negative slot masks the whole row (vLLM's -1 padding),
slot 0 is an ordinary slot (page 0 is the pool's padding sink).
"""

# No `from __future__ import annotations` here: Triton 3.0's interpreter (TRITON_INTERPRET=1)
# treats a parameter as constexpr only if its annotation is the tl.constexpr class, not a string
# (tests/test_review_dependency_floors.py).

from typing import Any

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvpool.kernels import _common as c
from kvpool.kernels.launch import CompiledLaunch, Plan, launch_planned


@triton.jit
def _store_row(
    cache_ptr, x_ptr, cache_off, x_off, hd_cache, hd_x, mask,
    scale, SCALE_IS_PTR: tl.constexpr, HAS_SCALE: tl.constexpr,
    IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):
    x = tl.load(x_ptr + x_off + hd_x, mask=mask, other=0.0)
    if HAS_SCALE:
        if SCALE_IS_PTR:
            s = tl.load(scale).to(tl.float32)
        else:
            s = scale
        # div_rn: IEEE division like torch's x / scale (plain `/` is div.full.f32 on
        # NVIDIA, up to 2 ulp off, which can flip an fp8/bf16 rounding).
        y = tl.div_rn(x.to(tl.float32), s)
        if IS_FP8:
            # Saturate, as fp8 has no inf. NaN must stay NaN (torch's clamp keeps it);
            # the default min/max return the non-NaN operand, turning NaN into -FP8_MAX.
            y = tl.minimum(tl.maximum(y, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                           propagate_nan=tl.PropagateNan.ALL)
        tl.store(cache_ptr + cache_off + hd_cache, y.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        # Same dtype: a pure copy (also the only bf16 path the interpreter supports).
        tl.store(cache_ptr + cache_off + hd_cache, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    k_cache, v_cache, slots_ptr, k_ptr, v_ptr, k_scale, v_scale,
    n, H, D, PAGE,
    c_sp, c_so, c_sh, c_sd,          # K cache strides (page, offset-in-page, head, dim)
    vc_sp, vc_so, vc_sh, vc_sd,      # V cache strides
    k_sn, k_sh, k_sd, v_sn, v_sh, v_sd, slots_st,
    HAS_V: tl.constexpr, K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr,
    K_HAS_SCALE: tl.constexpr, V_HAS_SCALE: tl.constexpr,
    K_FP8: tl.constexpr, V_FP8: tl.constexpr, K_FP8_MAX: tl.constexpr, V_FP8_MAX: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr,
):
    # Tile [ROWS tokens, BLOCK_H heads, BLOCK_D dims]: one wide load and one wide
    # store per tensor, so all of a program's rows are in flight at once.
    # The host proved D and these strides multiples of VEC (_common.vec_hint); the
    # rewrite keeps each value and shows the compiler that divisibility.
    D = D // VEC * VEC
    c_sp, c_so, c_sh = c_sp // VEC * VEC, c_so // VEC * VEC, c_sh // VEC * VEC
    vc_sp, vc_so, vc_sh = vc_sp // VEC * VEC, vc_so // VEC * VEC, vc_sh // VEC * VEC
    k_sn, k_sh, v_sn, v_sh = k_sn // VEC * VEC, k_sh // VEC * VEC, v_sn // VEC * VEC, v_sh // VEC * VEC
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)                  # [R]
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[None, :, None]  # [1, BH, 1]
    d = tl.arange(0, BLOCK_D)[None, None, :]                          # [1, 1, BD]
    # int64 so slot * stride cannot overflow on multi-GiB caches. slots may be any
    # 1-D view (a column of a batch tensor): element i is at i * slots_st.
    slot = tl.load(slots_ptr + tl.minimum(t, n - 1).to(tl.int64) * slots_st).to(tl.int64)
    slot = tl.where(t < n, slot, -1)
    # A skipped row shrinks its dim limit to 0. Arithmetic, not tl.where(slot >= 0, D, 0)
    # nor a per-row bool and-ed into the mask: D * {0, 1} keeps D's divisibility, so the
    # compiler still sees the mask as uniform over each thread's run of d and emits
    # 16-byte vector loads/stores (Triton 3.9 falls back to one element per access with
    # the where-form); and the interpreter mistypes mixed-rank bool ands.
    lim = (D * (slot >= 0).to(tl.int32))[:, None, None]               # [R, 1, 1]
    mask = (h < H) & (d < lim)
    page = slot // PAGE
    off = slot - page * PAGE
    t64 = t.to(tl.int64)[:, None, None]
    _store_row(k_cache, k_ptr, (page * c_sp + off * c_so)[:, None, None], t64 * k_sn,
               h * c_sh + d * c_sd, h * k_sh + d * k_sd, mask,
               k_scale, K_SCALE_PTR, K_HAS_SCALE, K_FP8, K_FP8_MAX)
    if HAS_V:
        _store_row(v_cache, v_ptr, (page * vc_sp + off * vc_so)[:, None, None], t64 * v_sn,
                   h * vc_sh + d * vc_sd, h * v_sh + d * v_sd, mask,
                   v_scale, V_SCALE_PTR, V_HAS_SCALE, V_FP8, V_FP8_MAX)


# Batches from this many rows on are prefill-sized: more rows per program.
_PREFILL_ROWS = 2048


def rows_per_program(n: int, tile_elems: int = 1024, itemsize: int = 2) -> int:
    """Tokens per program. Prefill-sized batches: enough rows for a ~4096-element
    tile (more bytes in flight per program, fewer blocks to schedule); decode
    batches: one token per program, so that n programs spread over the SMs, unless
    one row is too short to give a warp 16 bytes a thread (``itemsize``: the
    narrowest element moved): then as many rows as fill one warp."""
    if n < _PREFILL_ROWS:
        return c.rows_to_fill_warp(tile_elems, itemsize)
    return max(1, min(8, c.MAX_TILE // tile_elems))


_LAUNCH = CompiledLaunch(_store_kv_kernel)
_PLANS: dict[tuple, Plan] = {}  # plan key -> plan (kvpool.kernels.launch)


def launch_store_kv(
    k_cache: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, vv: torch.Tensor,
    kg: c.CacheGeom, vg: c.CacheGeom, has_v: bool, k_scale: c.Scale, v_scale: c.Scale,
) -> None:
    """One launch of the store kernel; arguments validated by ``kvpool.kernels.store_kv``
    (without V, ``vc``/``vv``/``vg`` are K's, never touched).

    Everything derived from the shapes, strides and dtypes (tile, vector width, rows per
    program, constexprs) is computed once per plan key and kept; the key also holds
    what Triton specialises on (see ``kvpool.kernels.launch``), so a plan's compiled
    kernel is launched directly after its first launch."""
    n = k.shape[0]
    ks, _ = c.scale_args(k_scale, k)
    vs, _ = c.scale_args(v_scale if has_v else None, vv)
    key = store_key(store_key_constant(k_cache, vc, kg, vg, has_v, k_scale, v_scale), slots, k, vv,
                    k_cache.get_device())
    launch_planned(_LAUNCH, _store_kv_kernel, _PLANS, key,
                   lambda: _plan(k_cache, vc, slots, k, vv, kg, vg, has_v, k_scale, v_scale, n),
                   (k_cache, vc, slots, k, vv, ks, vs), n, k_cache.is_cuda)


def store_key_constant(k_cache: torch.Tensor, vc: torch.Tensor, kg: c.CacheGeom, vg: c.CacheGeom, has_v: bool,
                       k_scale: c.Scale, v_scale: c.Scale) -> tuple:
    """The part of a store launch's plan key that its caches and scales fix (a pool's never
    change: ``kernels.layer_stores`` computes it once per layer)."""
    ks, ks_ptr = c.scale_args(k_scale, k_cache)
    vs, vs_ptr = c.scale_args(v_scale if has_v else None, vc)
    return (kg, vg, has_v, k_cache.dtype, vc.dtype, k_scale is None, v_scale is None,
            ks.dtype if ks_ptr else None, vs.dtype if vs_ptr else None,
            k_cache.data_ptr() % 16 == 0, vc.data_ptr() % 16 == 0,
            ks.data_ptr() % 16 == 0 if ks_ptr else None, vs.data_ptr() % 16 == 0 if vs_ptr else None)


def store_key(constant: Any, slots: torch.Tensor, k: torch.Tensor, vv: torch.Tensor, device: int) -> tuple:
    """A store launch's plan key: ``constant`` (``store_key_constant``'s tuple, or a stand-in
    that names one), then what the call's slots and rows add, the device index last
    (``launch_planned`` launches on ``key[-1]``). The one definition of the key, so that the
    pool's own stores and ``launch_store_kv`` specialise alike."""
    n = k.shape[0]
    return (constant, k.dtype, vv.dtype, slots.dtype, k.stride(), vv.stride(), slots.stride(0),
            n >= _PREFILL_ROWS, n == 1, n % 16 == 0, n >= 1 << 31,
            slots.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0, vv.data_ptr() % 16 == 0, device)


def _plan(k_cache: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, vv: torch.Tensor,
          kg: c.CacheGeom, vg: c.CacheGeom, has_v: bool, k_scale: c.Scale, v_scale: c.Scale,
          n: int) -> Plan:
    k_fp8 = k_cache.dtype in c.FP8_DTYPES
    v_fp8 = vc.dtype in c.FP8_DTYPES
    heads, dim = kg.heads, kg.head_dim
    strides = [[kg.stride_page, kg.stride_off, kg.stride_h, kg.stride_d],
               [vg.stride_page, vg.stride_off, vg.stride_h, vg.stride_d],
               [k.stride(0), k.stride(1), k.stride(2)], [vv.stride(0), vv.stride(1), vv.stride(2)]]
    if c.contiguous_rows(heads, dim, [(x[-2], x[-1]) for x in strides]):
        heads, dim = 1, heads * dim
        for x in strides:
            x[-2] = dim
    itemsize = min(t.element_size() for t in (k_cache, vc, k, vv))
    vec = c.vec_hint(dim, [s for x in strides for s in x[:-1]], [x[-1] for x in strides], itemsize)
    per_thread = c.ACCESS_BYTES // itemsize
    block_h, block_d, _ = c.tile(heads, dim, itemsize)
    rows = rows_per_program(n, block_h * block_d, itemsize)
    warps = max(1, min(8, rows * block_h * block_d // (32 * per_thread)))  # 16 bytes a thread
    (kp, ko, kh, kd), (vp, vo, vh, vd), k_str, v_str = strides
    tail = (heads, dim, kg.page_size,
            kp, ko, kh, kd, vp, vo, vh, vd, *k_str, *v_str, slots.stride(0),
            has_v,  # HAS_V
            isinstance(k_scale, torch.Tensor), isinstance(v_scale, torch.Tensor) and has_v,  # K/V_SCALE_PTR
            k_fp8 or k_scale is not None, has_v and (v_fp8 or v_scale is not None),  # K/V_HAS_SCALE
            k_fp8, v_fp8,
            c.fp8_max(k_cache.dtype) if k_fp8 else 0.0, c.fp8_max(vc.dtype) if v_fp8 else 0.0,
            rows, block_h, block_d, vec)
    return tail, rows, triton.cdiv(heads, block_h), warps
