"""Triton kernel of ``kvpool.kernels.copy_slots`` (imported on the first launch only):
copy rows src_slots[i] -> dst_slots[i] in every cache (all layers,
K and V) in one launch — copy-on-write of a shared page, compaction.

Design (works compiled and under the Triton interpreter): the interpreter cannot
dereference pointers loaded from memory, so there is no pointer table. Instead
every cache is addressed as caches[0]'s base pointer plus an int64 *element*
offset (its data_ptr minus caches[0]'s, divided by the element size), loaded
from a small device tensor. Offsets are plain integers, which both the compiler
and the interpreter accept. This needs all caches in one launch to share dtype
and row geometry (true for a pool's K/V buffers); caches that differ are
grouped and each group gets its own launch. The offsets tensor is built once
per set of caches and cached (copy_tables.py: tables a captured graph reads are
never freed), so steady-state calls (and graph capture after a warm-up call)
allocate nothing.
"""

# No `from __future__ import annotations` here: Triton 3.0's interpreter (TRITON_INTERPRET=1)
# treats a parameter as constexpr only if its annotation is the tl.constexpr class, not a string
# (tests/test_review_dependency_floors.py).

from collections.abc import Sequence

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvpool.kernels import _common as c
from kvpool.kernels.copy_tables import TABLES
from kvpool.kernels.launch import OPTIONS


@triton.jit
def _copy_slots_kernel(
    base_ptr, deltas_ptr, src_ptr, dst_ptr,
    H, D, PAGE, c_sp, c_so, c_sh, c_sd,
    n, src_st, dst_st,
    ALIGN: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr,
):
    # Tile [ROWS pairs, BLOCK_H heads, BLOCK_D dims]; ROWS > 1 only when one row is
    # too short to give every thread of a warp 16 bytes.
    # D and the strides are multiples of VEC (host-checked): see store.py.
    D = D // VEC * VEC
    c_sp, c_so, c_sh = c_sp // VEC * VEC, c_so // VEC * VEC, c_sh // VEC * VEC
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)                  # [R]
    # Offsets are stored in units of ALIGN elements: multiplying by the constexpr
    # tells the compiler the 16-byte alignment (for vector loads) without a hint.
    cache_ptr = base_ptr + tl.load(deltas_ptr + tl.program_id(1)) * ALIGN
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)[None, :, None]  # [1, BH, 1]
    d = tl.arange(0, BLOCK_D)[None, None, :]                          # [1, 1, BD]
    i = tl.minimum(t, n - 1).to(tl.int64)  # src/dst may be any 1-D views
    src = tl.load(src_ptr + i * src_st).to(tl.int64)
    dst = tl.load(dst_ptr + i * dst_st).to(tl.int64)
    # Skipped pairs (and rows past n) shrink the dim limit to 0, arithmetically so that
    # D's divisibility survives (store.py); the interpreter mistypes mixed-rank bool ands.
    lim = (D * ((t < n) & (src >= 0) & (dst >= 0)).to(tl.int32))[:, None, None]
    mask = (h < H) & (d < lim)
    hd = h * c_sh + d * c_sd
    sp = src // PAGE
    dp = dst // PAGE
    src_off = (sp * c_sp + (src - sp * PAGE) * c_so)[:, None, None]
    dst_off = (dp * c_sp + (dst - dp * PAGE) * c_so)[:, None, None]
    x = tl.load(cache_ptr + src_off + hd, mask=mask)
    tl.store(cache_ptr + dst_off + hd, x, mask=mask)


def launch_copy_slots(
    caches: Sequence[torch.Tensor], geoms: Sequence[c.CacheGeom], src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Launches of the copy kernel, one per group of like caches; arguments validated
    by ``kvpool.kernels.copy_slots``."""
    n = src_slots.shape[0]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t, g in zip(caches, geoms):
        groups.setdefault((t.dtype,) + tuple(g), []).append(t)
    for group in groups.values():  # one launch for the usual uniform pool
        g = c.cache_geom(group[0], "caches")
        table, align = TABLES.get(group)
        heads, dim, sh = g.heads, g.head_dim, g.stride_h
        if c.contiguous_rows(heads, dim, [(g.stride_h, g.stride_d)]):
            heads, dim, sh = 1, heads * dim, heads * dim
        vec = c.vec_hint(dim, [g.stride_page, g.stride_off, sh], [g.stride_d], group[0].element_size())
        block_h, block_d, warps = c.tile(heads, dim, group[0].element_size())
        rows = c.rows_to_fill_warp(block_h * block_d, group[0].element_size())
        grid = (triton.cdiv(n, rows), len(group), triton.cdiv(heads, block_h))
        _copy_slots_kernel[grid](
            group[0], table, src_slots, dst_slots,
            heads, dim, g.page_size, g.stride_page, g.stride_off, sh, g.stride_d, n,
            src_slots.stride(0), dst_slots.stride(0),
            ALIGN=align, ROWS=rows, BLOCK_H=block_h, BLOCK_D=block_d, VEC=vec, num_warps=warps, **OPTIONS,
        )
