"""Torch implementations of every kernel: the CPU path of the wrappers and the
reference the Triton kernels are tested against. Same semantics, element for
element: negative slots / rows are skipped; fp8 stores x / scale clamped to the
format's finite range."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.kernels._common import Scale, fp8_max
from kvpool.torch_types import FP8_DTYPES


def _scale_value(scale: Scale) -> torch.Tensor | float:
    if isinstance(scale, torch.Tensor):
        return scale.reshape(()).float()
    return 1.0 if scale is None else float(scale)


def _divisor(scale: Scale, like: torch.Tensor) -> torch.Tensor:
    """The scale as the store kernel divides by it: a float32 value, as a tensor on x's
    device. Never a Python float: on CUDA, torch divides by a host scalar as
    x * (1 / s), up to 1 ulp away from the kernel's IEEE division (tl.div_rn by the
    scale rounded to float32), which can flip an fp8/bf16 rounding."""
    if isinstance(scale, torch.Tensor):
        return scale.reshape(1).float()
    return torch.full((1,), 1.0 if scale is None else float(scale), dtype=torch.float32, device=like.device)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: Scale) -> torch.Tensor:
    """What the store kernel writes for x into a cache of `dtype`: x / scale with IEEE
    float32 division (fp8: clamped to the format's finite range; NaN stays NaN)."""
    if dtype in FP8_DTYPES:
        m = fp8_max(dtype)
        return (x.float() / _divisor(scale, x)).clamp(-m, m).to(dtype)
    if scale is not None:
        return (x.float() / _divisor(scale, x)).to(dtype)
    return x.to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: Scale) -> torch.Tensor:
    """What the gather kernel writes for cache rows x read as `dtype` (x * scale with one).
    Into fp8, clamped to the format's finite range (NaN stays NaN) as the GPU's conversion
    saturates (cvt.rn.satfinite): torch's own cast takes float8_e5m2 past its range to inf."""
    if dtype in FP8_DTYPES:
        m = fp8_max(dtype)
        y = x.float() if scale is None else x.float() * _scale_value(scale)
        return y.clamp(-m, m).to(dtype)
    if scale is None:
        return x.to(dtype)
    return (x.float() * _scale_value(scale)).to(dtype)


def _flat(cache: torch.Tensor) -> torch.Tensor | None:
    """[num_slots, H, D] view of a cache, or None when its strides don't allow one."""
    if cache.dim() == 3:
        return cache
    try:
        return cache.view(-1, *cache.shape[-2:])
    except RuntimeError:
        return None


def _index(cache: torch.Tensor, slots: torch.Tensor):
    """Index tuple addressing `slots` in a token-major or paged cache."""
    slots = slots.long()
    if cache.dim() == 3:
        return (slots,)
    p = cache.shape[1]
    return (torch.div(slots, p, rounding_mode="floor"), slots % p)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # index_copy_ has no fp8 kernels on CPU; a same-size integer view copies the bits.
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    flat = _flat(cache)
    if flat is not None:  # index_copy_: far cheaper on CPU than advanced-index assignment
        _bytes(flat).index_copy_(0, slots.long(), _bytes(rows))
    else:
        cache[_index(cache, slots)] = rows


def _read_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    flat = _flat(cache)
    if flat is not None:
        return _bytes(flat).index_select(0, slots.long()).view(cache.dtype)
    return cache[_index(cache, slots)]


def _kept(mask: torch.Tensor) -> torch.Tensor | None:
    """Indices where mask holds, or None when it holds everywhere (the common case).
    nonzero + index_select rather than boolean indexing, which is slow on CPU."""
    if bool(mask.all()):
        return None
    return mask.nonzero().squeeze(1)


def store_kv_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> None:
    keep = _kept(slots >= 0)
    pick = (lambda t: t) if keep is None else (lambda t: t.index_select(0, keep))
    s = pick(slots)
    _write_rows(k_cache, s, quantize(pick(k), k_cache.dtype, k_scale))
    if v_cache is not None and v is not None:
        _write_rows(v_cache, s, quantize(pick(v), v_cache.dtype, v_scale))


def gather_kv_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slots: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows at `slots` as contiguous [n, H, D]; rows of negative slots are zero."""
    neg = slots < 0

    def one(cache: torch.Tensor, scale: Scale) -> torch.Tensor:
        dt = out_dtype or cache.dtype
        rows = _read_rows(cache, slots.clamp(min=0))
        if scale is not None or dt != cache.dtype:
            rows = dequantize(rows, dt, scale)
        if bool(neg.any()):
            zero = torch.zeros((), dtype=torch.uint8, device=rows.device)
            rows = torch.where(neg.view(-1, 1, 1), zero, _bytes(rows)).view(dt) if rows.element_size() == 1 \
                else torch.where(neg.view(-1, 1, 1), torch.zeros((), dtype=dt, device=rows.device), rows)
        return rows.contiguous()

    k = one(k_cache, k_scale)
    v = one(v_cache, v_scale) if v_cache is not None else None
    return k, v


def copy_slots_ref(
    caches: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    keep = _kept((src_slots >= 0) & (dst_slots >= 0))
    src = src_slots if keep is None else src_slots.index_select(0, keep)
    dst = dst_slots if keep is None else dst_slots.index_select(0, keep)
    for cache in caches:
        _write_rows(cache, dst, _read_rows(cache, src))


def write_req_to_token_ref(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """One batched index_put_; requests with a negative row or a count <= 0 are skipped
    (a positive count of a skipped request still occupies its span of `slots`)."""
    counts = counts.long().clamp(min=0)
    total = int(counts.sum())
    if total == 0:
        return
    offsets = torch.cumsum(counts, 0) - counts
    # Per slot: its request's row, and its column = start + position within the request.
    row = torch.repeat_interleave(rows.long(), counts, output_size=total)
    col = torch.repeat_interleave(starts.long() - offsets, counts, output_size=total)
    col += torch.arange(total, device=col.device)
    vals = slots[:total].to(req_to_token.dtype)
    keep = _kept(row >= 0)
    if keep is not None:
        row, col, vals = row.index_select(0, keep), col.index_select(0, keep), vals.index_select(0, keep)
    req_to_token.index_put_((row, col), vals)
