"""Torch implementations of every kernel: the CPU path of the wrappers and the
reference the Triton kernels are tested against. Same semantics, element for
element: negative slots / rows are skipped; fp8 stores x / scale clamped to the
format's finite range."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from kvpool.kernels._common import FP8_DTYPES, Scale, fp8_max


def _scale_value(scale: Scale) -> torch.Tensor | float:
    if isinstance(scale, torch.Tensor):
        return scale.reshape(()).float()
    return 1.0 if scale is None else float(scale)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: Scale) -> torch.Tensor:
    """What the store kernel writes for x into a cache of `dtype`."""
    if dtype in FP8_DTYPES:
        m = fp8_max(dtype)
        return (x.float() / _scale_value(scale)).clamp(-m, m).to(dtype)
    if scale is not None:
        return (x.float() / _scale_value(scale)).to(dtype)
    return x.to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: Scale) -> torch.Tensor:
    if scale is None:
        return x.to(dtype)
    return (x.float() * _scale_value(scale)).to(dtype)


def _index(cache: torch.Tensor, slots: torch.Tensor):
    """Index tuple addressing `slots` in a token-major or paged cache."""
    slots = slots.long()
    if cache.dim() == 3:
        return (slots,)
    p = cache.shape[1]
    return (torch.div(slots, p, rounding_mode="floor"), slots % p)


def store_kv_ref(
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    slots: torch.Tensor,
    k: torch.Tensor,
    v: Optional[torch.Tensor],
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> None:
    keep = slots >= 0
    s = slots[keep]
    k_cache[_index(k_cache, s)] = quantize(k[keep], k_cache.dtype, k_scale)
    if v_cache is not None and v is not None:
        v_cache[_index(v_cache, s)] = quantize(v[keep], v_cache.dtype, v_scale)


def gather_kv_ref(
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    slots: torch.Tensor,
    out_dtype: Optional[torch.dtype] = None,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Rows at `slots` as contiguous [n, H, D]; rows of negative slots are zero."""

    def one(cache: torch.Tensor, scale: Scale) -> torch.Tensor:
        dt = out_dtype or cache.dtype
        h, d = cache.shape[-2:]
        out = torch.zeros((slots.shape[0], h, d), dtype=dt, device=cache.device)
        keep = slots >= 0
        rows = cache[_index(cache, slots[keep])]
        out[keep] = dequantize(rows, dt, scale) if (scale is not None or dt != cache.dtype) else rows
        return out

    k = one(k_cache, k_scale)
    v = one(v_cache, v_scale) if v_cache is not None else None
    return k, v


def copy_slots_ref(
    caches: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    keep = (src_slots >= 0) & (dst_slots >= 0)
    src, dst = src_slots[keep], dst_slots[keep]
    for cache in caches:
        cache[_index(cache, dst)] = cache[_index(cache, src)]


def write_req_to_token_ref(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    offsets: List[int] = [0]
    for c in counts.tolist():
        offsets.append(offsets[-1] + max(int(c), 0))
    for i, (r, st, c) in enumerate(zip(rows.tolist(), starts.tolist(), counts.tolist())):
        if r < 0 or c <= 0:
            continue
        o = offsets[i]
        req_to_token[r, st : st + c] = slots[o : o + c].to(req_to_token.dtype)
