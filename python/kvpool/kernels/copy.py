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

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvpool.kernels import _common as c
from kvpool.kernels.copy_tables import TABLES


@triton.jit
def _copy_slots_kernel(
    base_ptr, deltas_ptr, src_ptr, dst_ptr,
    H, D, PAGE, c_sp, c_so, c_sh, c_sd,
    ALIGN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    # Offsets are stored in units of ALIGN elements: multiplying by the constexpr
    # tells the compiler the 16-byte alignment (for vector loads) without a hint.
    cache_ptr = base_ptr + tl.load(deltas_ptr + tl.program_id(1)) * ALIGN
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    src = tl.load(src_ptr + t).to(tl.int64)
    dst = tl.load(dst_ptr + t).to(tl.int64)
    # Skipped pairs shrink the dim limit to 0 (the interpreter mistypes tensor & scalar bools).
    mask = (h < H) & (d < tl.where(src >= 0, tl.where(dst >= 0, D, 0), 0))
    hd = h * c_sh + d * c_sd
    sp = src // PAGE
    dp = dst // PAGE
    x = tl.load(cache_ptr + sp * c_sp + (src - sp * PAGE) * c_so + hd, mask=mask)
    tl.store(cache_ptr + dp * c_sp + (dst - dp * PAGE) * c_so + hd, x, mask=mask)


def launch_copy_slots(
    caches: Sequence[torch.Tensor], geoms: Sequence[c.CacheGeom], src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Launches of the copy kernel, one per group of like caches; arguments validated
    by ``kvpool.kernels.copy_slots``."""
    n = src_slots.shape[0]
    groups: Dict[Tuple, List[torch.Tensor]] = {}
    for t, g in zip(caches, geoms):
        groups.setdefault((t.dtype,) + tuple(g), []).append(t)
    for group in groups.values():  # one launch for the usual uniform pool
        g = c.cache_geom(group[0], "caches")
        table, align = TABLES.get(group)
        block_h, block_d, warps = c.tile(g.heads, g.head_dim)
        grid = (n, len(group), triton.cdiv(g.heads, block_h))
        _copy_slots_kernel[grid](
            group[0], table, src_slots, dst_slots,
            g.heads, g.head_dim, g.page_size, g.stride_page, g.stride_off, g.stride_h, g.stride_d,
            ALIGN=align, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=warps,
        )
