"""The dtype sets and device normalisation every layer of kvpool shares.

Defined once here (torch only: no Triton, no Rust), so the pool, its argument
checks and the kernels cannot disagree on what counts as fp8 or as an index.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpool._core import InvalidArgumentError

__all__ = ["CACHE_DTYPES", "COMPUTE_DTYPES", "FP8_DTYPES", "GATHER_DTYPES", "INDEX_DTYPES", "INT_DTYPES", "as_device"]

#: FP8 formats a cache may be stored in (those this torch build has).
FP8_DTYPES: tuple[torch.dtype, ...] = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)
#: Dtypes a K/V cache (and the rows written into it) may have.
CACHE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16) + FP8_DTYPES
#: Dtypes an fp8 pool's reads convert to (its ``compute_dtype``).
COMPUTE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: Dtypes ``kernels.gather_kv`` converts to: any cache dtype, and float64 for a reference computed in it.
GATHER_DTYPES: tuple[torch.dtype, ...] = CACHE_DTYPES + (torch.float64,)
#: Dtypes of slot ids, table rows and the request-to-token table.
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)
#: Integer dtypes a host id array may come as (not the quantized or bits dtypes, which
#: ``Tensor.numpy()`` refuses untyped).
INT_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64,
                        torch.uint8, torch.uint16, torch.uint32, torch.uint64})


def as_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` that compares exactly.

    A bare ``"cuda"`` becomes ``cuda:<current device>`` (torch says
    ``"cuda" != "cuda:0"``, and tensors always carry an index).

    Raises:
        InvalidArgumentError: ``device`` is not a torch device, or it is a CUDA
            device and ``torch.cuda.is_available()`` is False.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:  # ValueError: an index past int64
        raise InvalidArgumentError(f"device {device!r} is not a torch device: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(f"device {device!r} asked for, but torch.cuda.is_available() is False; use 'cpu'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
