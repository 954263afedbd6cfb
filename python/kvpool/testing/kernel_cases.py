"""Shared data builders for the kernel tests (CPU torch path, interpreter path, CUDA path).

Values are chosen so every conversion is exact (inputs representable in the cache
dtype, power-of-two scales): the Triton interpreter converts fp32 -> bf16 / fp8 by
truncation while torch and GPUs round to nearest, so only exact values make a
bitwise comparison meaningful everywhere. Caches start as random bytes, so a stray
write anywhere is visible in a bitwise comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # optional: only the strategies need it (gpu_check runs where hypothesis may be missing)
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    st = None

FP8 = torch.float8_e4m3fn
CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, FP8]
LAYOUTS = ["token", "paged", "interleaved"]  # interleaved: K/V views of one [S, 2, H, D] buffer


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise view for exact comparison (NaN-safe, works for fp8)."""
    # reshape(-1) first: a contiguous tensor may still carry stride 0 on a size-1 dim.
    return t.contiguous().reshape(-1).view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def random_bytes(shape, dtype, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """A tensor of arbitrary bit patterns (may include NaN/inf): garbage to detect stray writes."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).to(device)


def make_caches(layout: str, num_slots: int, page: int, heads: int, dim: int, dtype, gen, device="cpu"):
    """(k_cache, v_cache) with num_slots slots in the given layout, filled with garbage."""
    if layout == "token":
        return tuple(random_bytes((num_slots, heads, dim), dtype, gen, device) for _ in range(2))
    if layout == "paged":
        return tuple(
            random_bytes((num_slots // page, page, heads, dim), dtype, gen, device) for _ in range(2)
        )
    buf = random_bytes((num_slots, 2, heads, dim), dtype, gen, device)
    return buf[:, 0], buf[:, 1]


def exact_values(n: int, heads: int, dim: int, cache_dtype, in_dtype, scale: float, gen, device="cpu"):
    """Inputs x with x / scale exactly representable in cache_dtype (scale a power of two).
    For fp8, about one value in 16 is far out of range to exercise the clamp."""
    base = torch.randn((n, heads, dim), generator=gen) * 4
    q = base.to(cache_dtype).float()  # representable values
    if cache_dtype == FP8:
        big = torch.rand((n, heads, dim), generator=gen) < 1 / 16
        q = torch.where(big, torch.sign(base) * 4096.0 + (base == 0).float() * 4096.0, q)
    return (q * scale).to(in_dtype).to(device)


def input_dtype_for(cache_dtype, pick: int):
    """An input dtype whose values convert exactly to cache_dtype after scaling."""
    if cache_dtype == torch.bfloat16:
        return [torch.bfloat16, torch.float32][pick % 2]
    if cache_dtype == FP8:
        return [torch.float16, torch.float32][pick % 2]
    if cache_dtype == torch.float16:
        return [torch.float16, torch.float32][pick % 2]
    return torch.float32


@dataclass
class StoreCase:
    layout: str
    page: int
    num_slots: int
    heads: int
    dim: int
    cache_dtype: torch.dtype
    in_dtype: torch.dtype
    slots: list[int]
    scale_kind: str  # "none" | "float" | "tensor"
    with_v: bool
    slot_dtype: torch.dtype


def _composite(fn):
    return st.composite(fn) if st is not None else fn


@_composite
def store_cases(draw, max_n: int = 12, dtypes=None) -> StoreCase:
    layout = draw(st.sampled_from(LAYOUTS))
    page = draw(st.sampled_from([1, 2, 4, 16])) if layout == "paged" else 1
    num_slots = page * draw(st.integers(2, 6)) if layout == "paged" else draw(st.integers(2, 40))
    heads = draw(st.sampled_from([1, 2, 3, 4, 8]))  # GQA-style KV head counts incl. non-pow2
    dim = draw(st.sampled_from([1, 7, 16, 40, 64, 72, 80, 96, 128, 576]))
    cache_dtype = draw(st.sampled_from(dtypes or CACHE_DTYPES))
    in_dtype = input_dtype_for(cache_dtype, draw(st.integers(0, 1)))
    n = draw(st.integers(0, min(max_n, num_slots)))
    chosen = draw(st.lists(st.integers(0, num_slots - 1), min_size=n, max_size=n, unique=True))
    pad = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    slots = [-1 if p else s for s, p in zip(chosen, pad)]
    scale_kind = draw(st.sampled_from(["none", "float", "tensor"]))
    if cache_dtype == torch.bfloat16 and in_dtype == torch.bfloat16:
        scale_kind = "none"  # scaling computes on the input; the interpreter can't do bf16 math
    return StoreCase(layout, page, num_slots, heads, dim, cache_dtype, in_dtype, slots, scale_kind,
                     draw(st.booleans()) or layout == "interleaved",
                     draw(st.sampled_from([torch.int32, torch.int64])))


def scale_of(kind: str, value: float, device="cpu"):
    if kind == "none":
        return None
    if kind == "float":
        return value
    return torch.tensor([value], dtype=torch.float32, device=device)


def build_store(case: StoreCase, seed: int, device="cpu"):
    """(k_cache, v_cache|None, slots, k, v|None, k_scale, v_scale) for a case."""
    gen = torch.Generator().manual_seed(seed)
    kc, vc = make_caches(case.layout, case.num_slots, case.page, case.heads, case.dim,
                         case.cache_dtype, gen, device)
    ks_val, vs_val = (0.5, 2.0) if case.scale_kind != "none" else (1.0, 1.0)
    n = len(case.slots)
    k = exact_values(n, case.heads, case.dim, case.cache_dtype, case.in_dtype, ks_val, gen, device)
    v = exact_values(n, case.heads, case.dim, case.cache_dtype, case.in_dtype, vs_val, gen, device)
    slots = torch.tensor(case.slots, dtype=case.slot_dtype, device=device)
    if not case.with_v:
        vc, v = None, None
    return (kc, vc, slots, k, v, scale_of(case.scale_kind, ks_val, device),
            scale_of(case.scale_kind, vs_val, device) if case.with_v else None)


def slot_rows(cache: torch.Tensor) -> torch.Tensor:
    """[num_slots, H, D] view (or copy, for non-viewable strides) of a cache, by slot id."""
    h, d = cache.shape[-2:]
    return cache.reshape(-1, h, d)


def untouched_equal(before: torch.Tensor, after: torch.Tensor, targets: list[int]) -> bool:
    """Every slot not in targets is bitwise unchanged."""
    b, a = slot_rows(before), slot_rows(after)
    keep = torch.ones(b.shape[0], dtype=torch.bool)
    for s in targets:
        if s >= 0:
            keep[s] = False
    # Indexed as bytes: torch < 2.5 has no CPU indexing of fp8 tensors.
    return torch.equal(b.contiguous().view(torch.uint8)[keep], a.contiguous().view(torch.uint8)[keep])


def clone_opt(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()
