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
per set of caches and cached, so steady-state calls (and graph capture after a
warm-up call) allocate nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Sequence, Tuple

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvpool.kernels import _common as c
from kvpool.modes import persistent


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


_MAX_CACHED = 16
_deltas_cache: "OrderedDict[Tuple, Tuple[torch.Tensor, int]]" = OrderedDict()


def _deltas(group: List[torch.Tensor]) -> Tuple[torch.Tensor, int]:
    """(device int64 offsets from group[0] in units of `align` elements, align), cached."""
    key = (group[0].device, group[0].dtype) + tuple(t.data_ptr() for t in group)
    hit = _deltas_cache.get(key)
    if hit is not None:
        _deltas_cache.move_to_end(key)
        return hit
    if group[0].is_cuda and torch.cuda.is_current_stream_capturing():
        raise c.KernelArgumentError(
            "copy_slots: first call with this set of caches happened inside CUDA graph "
            "capture; call it once before capturing (warm-up) so its offsets table exists"
        )
    esize = group[0].element_size()
    base = group[0].data_ptr()
    diffs = [t.data_ptr() - base for t in group]
    if any(dlt % esize for dlt in diffs):
        raise c.KernelArgumentError("copy_slots: cache addresses are not element-aligned")
    align = 16 // esize if all(dlt % 16 == 0 for dlt in diffs) and esize <= 16 else 1
    with persistent():  # a long-lived tensor, reused by later calls and captured graphs
        table = torch.tensor([dlt // esize // align for dlt in diffs], dtype=torch.int64,
                             device=group[0].device)
    _deltas_cache[key] = (table, align)
    if len(_deltas_cache) > _MAX_CACHED:
        _deltas_cache.popitem(last=False)
    return table, align


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
        table, align = _deltas(group)
        block_h, block_d, warps = c.tile(g.heads, g.head_dim)
        grid = (n, len(group), triton.cdiv(g.heads, block_h))
        _copy_slots_kernel[grid](
            group[0], table, src_slots, dst_slots,
            g.heads, g.head_dim, g.page_size, g.stride_page, g.stride_off, g.stride_h, g.stride_d,
            ALIGN=align, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=warps,
        )
