"""K/V storage of a pool and its per-layer views (token-major and paged).

One allocation holds every cache kind (K and V, or the MLA latent cache), each
``[num_layers, num_slots, H, D]``, so each layer's block is contiguous and both layouts are views of the same memory:
token-major ``[num_slots, H, D]`` (SGLang) and paged ``[num_pages, P, H, D]``
(vLLM / FlashInfer NHD) differ only in how the first dimension is split.
Every tensor and view here is made under ``persistent()``, so none of them is
an inference tensor whatever mode the pool was built in.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvpool.modes import persistent
from kvpool.out_of_memory import refuse_out_of_memory
from kvpool.torch_types import FP8_DTYPES

__all__ = ["LAYOUTS", "KVStorage", "padded_row_stride", "padded_table"]

LAYOUTS = ("token", "paged")


def padded_row_stride(width: int, itemsize: int = 4) -> int:
    """Elements from one row of a ``[rows, width]`` table to the next: ``width``
    rounded up to an odd number of 64-byte cache lines.

    A decode step writes one entry in each of hundreds of rows. With a row
    stride that is a multiple of 4 KiB (any power-of-two ``max_context_len``)
    every row maps to the same L1 and L2 cache sets, so those writes miss
    cache on every step. An odd number of lines makes consecutive rows cycle
    through every set (benchmarks/results/ has the decode figures).
    """
    per_line = max(1, 64 // itemsize)
    lines = -(-max(width, 1) // per_line)
    return (lines | 1) * per_line


def padded_table(rows: int, width: int) -> np.ndarray:
    """A zeroed int32 ``[rows, width]`` host table laid out as ``KVPool.req_to_token``
    (a column slice of rows ``padded_row_stride(width)`` apart): what an engine
    that keeps its own CPU table passes as ``extend(table=)``."""
    return np.zeros((rows, padded_row_stride(width)), dtype=np.int32)[:, :width]


class KVStorage:
    """The caches of one pool plus cached per-layer views (no copies).

    ``caches`` is ``[k, v]`` or ``[latent]`` (MLA). For each cache and layer it
    keeps: ``flat`` (token-major, what the kernels are given) and ``shaped``
    (the pool's layout, what engines get).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        heads: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
        layout: str,
        mla: bool,
    ) -> None:
        self.num_slots = num_pages * page_size
        shape = (num_layers, self.num_slots, heads, dim)
        with persistent():
            # Zeros, not empty: padded entries of a batch read slot 0 (the null
            # row of req_to_token), and garbage there can be NaN/inf that leaks
            # through masked attention arithmetic.
            # K and V are two halves of one allocation, so every layer's K and V sit evenly
            # spaced in one storage and one strided view can cover all of them
            # (kvpool.integrations._pages builds a step's K/V views that way).
            caches = (1 if mla else 2,) + shape
            nbytes = math.prod(caches) * dtype.itemsize
            with refuse_out_of_memory("the pool's K/V caches", nbytes, device,
                                      "use fewer pages (num_pages, num_slots, memory_bytes or memory_fraction), "
                                      "layers, heads or a smaller head_dim"):
                # fp8 as zeroed bytes: torch < 2.5 has no CPU fill for fp8 (torch.zeros raised an
                # untyped RuntimeError); all-zero bits are +0.0 in every fp8 format.
                both = (torch.zeros(caches, dtype=torch.uint8, device=device).view(dtype) if dtype in FP8_DTYPES
                        else torch.zeros(caches, dtype=dtype, device=device))
            self.caches = list(both.unbind(0))
            self.flat = [[c[i] for i in range(num_layers)] for c in self.caches]
            if layout == "paged":
                self.shaped = [[f.view(num_pages, page_size, heads, dim) for f in fl] for fl in self.flat]
            else:
                self.shaped = self.flat

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.caches)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        names = ["kv_cache"] if len(self.caches) == 1 else ["k_cache", "v_cache"]
        return list(zip(names, self.caches))
