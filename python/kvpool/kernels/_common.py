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
from typing import NamedTuple, Optional, Union

import torch

from kvpool._core import InvalidArgumentError
from kvpool.errors import TensorDeviceError, TensorDtypeError, TensorShapeError, TritonUnavailableError
from kvpool.torch_types import CACHE_DTYPES, FP8_DTYPES, INDEX_DTYPES

__all__ = [
    "CACHE_DTYPES", "FP8_DTYPES", "INDEX_DTYPES", "INTERPRET", "KernelArgumentError", "Scale",
    "TritonUnavailableError", "require_triton", "use_triton",
]

# TRITON_INTERPRET is read by @triton.jit when the kernel modules are imported,
# so the dispatch decision must be taken from the same snapshot of the env.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Largest tile (elements per tensor) one program moves; keeps registers bounded.
MAX_TILE = 4096

Scale = Union[None, float, torch.Tensor]


class KernelArgumentError(InvalidArgumentError):
    """A kernel wrapper argument is wrong in a way not covered by the tensor
    shape / dtype / device errors of kvpool.errors (all share the base class)."""


_triton_error: Optional[BaseException] = None
_triton_checked = False


def _triton_importable() -> bool:
    """Whether ``import triton`` works; tried once, the failure kept for the message."""
    global _triton_checked, _triton_error
    if not _triton_checked:
        try:
            importlib.import_module("triton")
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
    the torch implementations in ``_ref`` everywhere else."""
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


def cache_geom(cache: torch.Tensor, name: str) -> CacheGeom:
    """Geometry of a token-major [num_slots, H, D] or paged [num_pages, P, H, D] cache."""
    if not isinstance(cache, torch.Tensor):
        raise KernelArgumentError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype not in CACHE_DTYPES:
        raise TensorDtypeError(
            f"{name} has dtype {cache.dtype}; expected one of {list(CACHE_DTYPES)}"
        )
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


def check_index(t: torch.Tensor, name: str, device: torch.device, n: Optional[int] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TensorDtypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != 1:
        raise TensorShapeError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.device != device:
        raise TensorDeviceError(f"{name} is on {t.device}, expected {device}")
    if n is not None and t.shape[0] != n:
        raise TensorShapeError(f"{name} has {t.shape[0]} entries, expected {n}")


def check_rows(x: torch.Tensor, name: str, geom: CacheGeom, device: torch.device) -> None:
    """x must be [n, H, D] matching the cache's heads and head_dim."""
    if not isinstance(x, torch.Tensor):
        raise KernelArgumentError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3 or tuple(x.shape[1:]) != (geom.heads, geom.head_dim):
        raise TensorShapeError(
            f"{name} must have shape [n, {geom.heads}, {geom.head_dim}], got {tuple(x.shape)}"
        )
    if x.device != device:
        raise TensorDeviceError(f"{name} is on {x.device}, expected {device}")
    if x.dtype not in CACHE_DTYPES:
        raise TensorDtypeError(f"{name} has dtype {x.dtype}; expected one of {list(CACHE_DTYPES)}")


def check_scale(scale: Scale, name: str, device: torch.device) -> None:
    if scale is None or isinstance(scale, (int, float)):
        if scale is not None and not float(scale) > 0.0:
            raise KernelArgumentError(f"{name} must be > 0, got {scale}")
        return
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        raise KernelArgumentError(f"{name} must be None, a float or a 1-element tensor")
    if scale.device != device:
        raise TensorDeviceError(f"{name} is on {scale.device}, expected {device}")


def scale_args(scale: Scale, like: torch.Tensor):
    """(value-or-pointer, IS_PTR) for a kernel. A tensor scale is read on device at launch
    (so a captured graph sees later updates); a float is baked into the launch."""
    if isinstance(scale, torch.Tensor):
        return scale, True
    return (1.0 if scale is None else float(scale)), False


def tile(heads: int, head_dim: int):
    """(BLOCK_H, BLOCK_D, num_warps): BLOCK_D covers head_dim (masked past it), BLOCK_H
    as many heads as fit in MAX_TILE elements."""
    block_d = triton_next_pow2(head_dim)
    block_h = max(1, min(triton_next_pow2(heads), MAX_TILE // block_d))
    elems = block_h * block_d
    num_warps = 8 if elems >= 4096 else (4 if elems >= 512 else 2)
    return block_h, block_d, num_warps


def triton_next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()
