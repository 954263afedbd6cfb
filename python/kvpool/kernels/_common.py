"""Shared helpers for the kernel wrappers: backend choice, validation, cache geometry.

Everything here is host-side Python that only reads tensor metadata (shape,
stride, dtype, device) — never tensor values — so the wrappers stay
capture-safe: no allocation, no device sync, no data-dependent branching.
Triton is imported only when a launch needs it, so CPU-only installs never
load it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kvpool.errors import (
    KernelArgumentError,
    SlotRangeError,
    TensorDeviceError,
    TensorDtypeError,
    TensorShapeError,
    TritonUnavailableError,
)
from kvpool.torch_types import CACHE_DTYPES, FP8_DTYPES, INDEX_DTYPES

__all__ = [
    "CACHE_DTYPES", "FP8_DTYPES", "INDEX_DTYPES", "INTERPRET", "KernelArgumentError", "Scale",
    "TritonUnavailableError", "check_dense", "check_writable", "require_triton", "use_triton",
]

# TRITON_INTERPRET is read by @triton.jit when the kernel modules are imported,
# so the dispatch decision must be taken from the same snapshot of the env.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Largest tile (elements per tensor) one program moves; keeps registers bounded.
MAX_TILE = 4096

Scale = float | torch.Tensor | None


_triton_error: BaseException | None = None
_triton_checked = False


# The kernels use tl.div_rn and propagate_nan, new in Triton 3.0 (shipped with torch 2.4).
MIN_TRITON = (3, 0)


def _version_tuple(v: str) -> tuple:
    parts = []
    for p in v.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _triton_importable() -> bool:
    """Whether ``import triton`` works and is new enough; tried once, the failure
    kept for the message."""
    global _triton_checked, _triton_error
    if not _triton_checked:
        try:
            triton = importlib.import_module("triton")
            version = str(getattr(triton, "__version__", "0"))
            if _version_tuple(version) < MIN_TRITON:
                raise ImportError(
                    f"triton {version} is older than {'.'.join(map(str, MIN_TRITON))}, which the "
                    "kernels need (tl.div_rn, propagate_nan); torch>=2.4 ships a new enough one"
                )
        except Exception as e:  # an ImportError, or a broken install failing at import
            _triton_error = e
        _triton_checked = True
    return _triton_error is None


def require_triton(device: torch.device) -> None:
    """Raise ``TritonUnavailableError`` unless Triton can run kernels on ``device``.

    Called by ``KVPool`` at construction, so a CUDA pool without Triton fails
    before it allocates anything instead of at its first write.
    """
    if device.type == "cuda" and not _triton_importable():
        raise TritonUnavailableError(
            f"kvpool moves K/V on {device} with Triton kernels, but `import triton` failed "
            f"({type(_triton_error).__name__}: {_triton_error}). Install the Triton that matches "
            f"torch {torch.__version__} (`pip install triton`; CUDA wheels of torch ship it as a "
            "dependency), or build the pool on 'cpu'. There is no torch fallback on CUDA: it "
            "could not skip negative (padding) slots without a device sync."
        )


def use_triton(t: torch.Tensor) -> bool:
    """Which backend moves ``t``'s data: Triton on CUDA (required: raises
    ``TritonUnavailableError`` without it) and on CPU under TRITON_INTERPRET=1;
    the torch implementations in ``_ref`` on CPU otherwise (``cache_geom`` refuses
    tensors on any other device)."""
    if t.is_cuda:
        require_triton(t.device)
        return True
    return INTERPRET and _triton_importable()


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


class CacheGeom(NamedTuple):
    """How slot s of a cache maps to memory: page = s // page_size, off = s % page_size,
    row start = page * stride_page + off * stride_off; element (h, d) at h*stride_h + d*stride_d."""

    num_slots: int
    heads: int
    head_dim: int
    page_size: int
    stride_page: int
    stride_off: int
    stride_h: int
    stride_d: int


def check_dense(x: torch.Tensor, name: str) -> None:
    """``x`` must be a dense (``torch.strided``) tensor: a sparse or mkldnn one has no
    strides to address rows by, and torch's copies into a dense tensor either refuse it
    untyped or (``index_copy_`` of mkldnn rows) crash the process."""
    if x.layout is not torch.strided:
        raise TensorShapeError(f"{name} is a {x.layout} tensor; kvpool takes dense (torch.strided) tensors "
                               f"(convert with {name}.to_dense())")


def check_writable(t: torch.Tensor, name: str) -> None:
    """``t`` must take an in-place write in the caller's mode, checked before anything is
    written: torch refuses the write only as it happens, after the calls before it (another
    cache, another layer) went through, and the Triton kernels, which write bytes, would
    not refuse it at all."""
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise KernelArgumentError(
            f"{name} is an inference tensor (made under torch.inference_mode()), which torch lets no "
            "in-place write change outside inference mode: create it outside inference mode "
            "(under kvpool.persistent()), or call this inside torch.inference_mode()")
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        # (torch refuses such a write untyped, after the ones before it; the kernels do it)
        raise KernelArgumentError(
            f"{name} has overlapping elements (a stride of 0, as expand makes): several slots would be one "
            f"memory, and a write to one would change the others; pass a tensor with memory of its own "
            f"({name}.contiguous())")
    if t.requires_grad and torch.is_grad_enabled():
        # A leaf (or a view of one) torch refuses to change; any other the Triton kernels would
        # change behind autograd's back.
        raise KernelArgumentError(
            f"{name} requires grad: in grad mode torch lets no in-place write change a leaf or a "
            "view of one, and the kernels' writes would bypass autograd: create it with "
            "requires_grad=False (kvpool.persistent()), or call this under torch.no_grad()")


def cache_geom(cache: torch.Tensor, name: str) -> CacheGeom:
    """Geometry of a token-major [num_slots, H, D] or paged [num_pages, P, H, D] cache."""
    if not isinstance(cache, torch.Tensor):
        raise KernelArgumentError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    check_dense(cache, name)
    if cache.device.type not in ("cpu", "cuda"):
        # (a meta tensor passes every other check, then fails untyped where a backend reads it)
        raise TensorDeviceError(f"{name} is on {cache.device}; the kernels run on CPU or CUDA tensors")
    if cache.dtype not in CACHE_DTYPES:
        raise TensorDtypeError(
            f"{name} has dtype {cache.dtype}; expected one of {list(CACHE_DTYPES)}"
        )
    if cache.is_neg():  # torch's ops negate through the bit; the kernels' raw reads and writes do not
        raise KernelArgumentError(f"{name} is a negative-bit view (as x.conj().imag makes): pass a cache "
                                  f"with its values in memory ({name}.resolve_neg() is a copy)")
    if cache.dim() == 3:
        s, h, d = cache.shape
        return CacheGeom(s, h, d, 1, cache.stride(0), 0, cache.stride(1), cache.stride(2))
    if cache.dim() == 4:
        pages, p, h, d = cache.shape
        return CacheGeom(
            pages * p, h, d, p, cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3)
        )
    raise TensorShapeError(
        f"{name} must be [num_slots, H, D] or [num_pages, page_size, H, D], "
        f"got shape {tuple(cache.shape)}"
    )


def check_index(t: torch.Tensor, name: str, device: torch.device, n: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_dense(t, name)
    if t.dtype not in INDEX_DTYPES:
        raise TensorDtypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != 1:
        raise TensorShapeError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.device != device:
        raise TensorDeviceError(f"{name} is on {t.device}, expected {device}")
    if n is not None and t.shape[0] != n:
        raise TensorShapeError(f"{name} has {t.shape[0]} entries, expected {n}")


def check_slot_range(t: torch.Tensor, name: str, num_slots: int) -> None:
    """Host (CPU) slots must be below ``num_slots``; negatives are padding. Device slots
    are not read (that would sync). On CPU the values are at hand, and without this a
    bad slot is an untyped IndexError after torch has stored the rows before it, or,
    under the Triton interpreter, a write past the cache into the process's heap."""
    if t.device.type != "cpu" or t.numel() == 0:
        return
    bad = t >= num_slots
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise SlotRangeError(
            f"{name}[{i}] = {int(t[i])} is out of range: valid slots are [0, {num_slots}) "
            "(negative slots are padding and are skipped)"
        )


def views_of(caches: Any, x: torch.Tensor | None) -> bool:
    """Whether ``x`` shares memory with one of ``caches`` (rows a caller moves within a
    layer): ``index_copy_`` refuses such a source, so it is copied out first. A source
    without readable storage is a typed refusal (``readable``)."""
    if x is None:
        return False
    ptr = readable(x)
    return any(t is not None and ptr == t.untyped_storage().data_ptr() for t in caches)


def rows_viewing(caches: Any, k: torch.Tensor, v: torch.Tensor | None) -> tuple[bool, bool]:
    """``(views_of(caches, k), views_of(caches, v))`` with each storage read once: a CUDA
    store asks this at every eager write, and each storage lookup costs ~0.4 µs of host time
    (four here against eight: readable's lookup is the rows')."""
    kp = readable(k)
    vp = None if v is None else readable(v)
    ptrs = [t.untyped_storage().data_ptr() for t in caches if t is not None]
    return kp in ptrs, vp is not None and vp in ptrs


def readable(x: torch.Tensor) -> int:
    """Refuse, before anything is written, rows without storage to copy from (a DTensor, a
    tensor batched by ``torch.func.vmap``): torch would refuse the copy of V after K's store
    went through. One storage read, under a microsecond (a DTensor's own ``data_ptr`` answers,
    its storage's does not). Returns the storage's address, which ``rows_viewing`` compares."""
    try:
        return x.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError) as err:
        raise TensorDeviceError(
            f"K/V rows of type {type(x).__name__} have no storage kvpool can copy from ({err}): pass plain "
            "tensors (a DTensor's to_local(); store outside torch.func.vmap)") from None


def check_rows(x: torch.Tensor, name: str, geom: CacheGeom, device: torch.device) -> None:
    """x must be [n, H, D] matching the cache's heads and head_dim."""
    if not isinstance(x, torch.Tensor):
        raise KernelArgumentError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    check_dense(x, name)
    if x.dim() != 3 or tuple(x.shape[1:]) != (geom.heads, geom.head_dim):
        raise TensorShapeError(
            f"{name} must have shape [n, {geom.heads}, {geom.head_dim}], got {tuple(x.shape)}"
        )
    if x.device != device:
        raise TensorDeviceError(f"{name} is on {x.device}, expected {device}")
    if x.dtype not in CACHE_DTYPES:
        raise TensorDtypeError(f"{name} has dtype {x.dtype}; expected one of {list(CACHE_DTYPES)}")


SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_scale(scale: Scale, name: str, device: torch.device) -> None:
    # A number of any kind (numpy's too, as read from a checkpoint), never a bool: True
    # would pass as 1.0, a flag passed where the scale goes.
    if scale is None or (isinstance(scale, (int, float, np.integer, np.floating))
                         and not isinstance(scale, (bool, np.bool_))):
        # inf passes "> 0" but stores every row as 0 (and gathers inf/NaN).
        if scale is not None and not 0.0 < float(scale) < float("inf"):
            raise KernelArgumentError(f"{name} must be > 0 and finite, got {scale}")
        return
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        raise KernelArgumentError(f"{name} must be None, a float or a 1-element tensor")
    if scale.dtype not in SCALE_DTYPES:  # metadata only: its value stays on the device
        raise KernelArgumentError(f"{name} is a tensor of {scale.dtype}; a scale tensor is float32, float16, "
                                  "bfloat16 or float64 (a bool or integer one is a flag or count passed by mistake)")
    if scale.is_neg():  # (read at launch from memory, which holds -scale: torch's path negates through the bit)
        raise KernelArgumentError(f"{name} is a negative-bit view (as x.conj().imag makes): pass a scale with its "
                                  f"value in memory ({name}.resolve_neg() is a copy)")
    if scale.device != device:
        raise TensorDeviceError(f"{name} is on {scale.device}, expected {device}")


def scale_args(scale: Scale, like: torch.Tensor):
    """(value-or-pointer, IS_PTR) for a kernel. A tensor scale is read on device at launch
    (so a captured graph sees later updates); a float is baked into the launch."""
    if isinstance(scale, torch.Tensor):
        return scale, True
    return (1.0 if scale is None else float(scale)), False


# Bytes one thread should move per global access: 16 is the widest vector access
# (ld/st.global.v4.b32), and anything narrower needs more instructions for the same row.
ACCESS_BYTES = 16


def tile(heads: int, head_dim: int, itemsize: int = 2):
    """(BLOCK_H, BLOCK_D, num_warps): BLOCK_D covers head_dim (masked past it), BLOCK_H
    as many heads as fit in MAX_TILE elements. ``itemsize`` is the element size of the
    narrowest tensor the kernel moves: the warps are chosen so that each thread holds
    16 bytes of it. The compiler gives a thread at most tile / threads elements, so
    more warps than that would shrink every access (4 warps over an 8 x 64 bf16 tile
    hold 4 elements, 8 bytes, a thread; an fp8 row needs 16 elements a thread)."""
    block_d = triton_next_pow2(head_dim)
    block_h = max(1, min(triton_next_pow2(heads), MAX_TILE // block_d))
    elems = block_h * block_d
    per_thread = max(1, ACCESS_BYTES // int(itemsize))
    num_warps = max(1, min(8, elems // (32 * per_thread)))
    return block_h, block_d, num_warps


def rows_to_fill_warp(tile_elems: int, itemsize: int) -> int:
    """Tokens per program for a per-token kernel: 1, or as many as give one warp 16
    bytes a thread when a single row is shorter (1 KV head x 128 bf16 is 256 bytes,
    a warp's 16-byte accesses cover 512)."""
    per_thread = max(1, ACCESS_BYTES // int(itemsize))
    return max(1, min(8, (32 * per_thread) // tile_elems))


def contiguous_rows(heads: int, head_dim: int, row_strides: Sequence[tuple[int, int]]) -> bool:
    """Whether each tensor's [heads, head_dim] row (its (head, dim) strides given) is one
    contiguous run of heads * head_dim elements that fits one tile.

    Such rows are moved as heads=1, head_dim=heads*head_dim: the row length, not
    head_dim, then decides how wide the accesses can be. With head_dim = 72 a head's
    row starts 144 bytes (bf16) or 72 bytes (fp8) after the previous one, so per-head
    fp8 accesses can be at most 8 bytes wide; the whole row of 8 heads is 576 bytes,
    a multiple of 16."""
    if heads * head_dim > MAX_TILE:
        return False
    return all(sd == 1 and (heads == 1 or sh == head_dim) for sh, sd in row_strides)


def vec_hint(head_dim: int, strides: Sequence[int], dim_strides: Sequence[int], itemsize: int) -> int:
    """The largest power of two VEC <= 16 bytes / itemsize (in elements) that divides
    head_dim and every page/offset/head/row stride, with every dim stride 1; else 1.

    Triton only specialises integer arguments on divisibility by 16, so head_dim = 72
    and its strides look unaligned to the compiler, which then moves one element per
    access. The kernels rewrite each such value as (x // VEC) * VEC: the same value,
    whose divisibility by VEC the compiler can see."""
    if any(s != 1 for s in dim_strides):
        return 1
    vec = max(1, ACCESS_BYTES // int(itemsize))
    while vec > 1 and (head_dim % vec or any(int(s) % vec for s in strides)):
        vec //= 2
    return vec


def triton_next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()
