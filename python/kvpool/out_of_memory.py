"""A pool whose tensors do not fit is a typed refusal, not torch's allocator error.

torch reports a failed allocation as ``torch.OutOfMemoryError`` on CUDA and as a
plain ``RuntimeError`` from ``DefaultCPUAllocator`` on the CPU; neither says
which of the pool's sizes to change. The core refuses metadata that does not fit
the same way (``InvalidArgumentError``, "cannot allocate ..."), so a caller
catches one error for a pool sized past its memory, whichever layer ran out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kvpool._core import InvalidArgumentError

__all__ = ["refuse_out_of_memory"]

# What torch's CPU allocator says when malloc or the page mapping fails.
_CPU_MESSAGES = ("can't allocate memory", "not enough memory", "Cannot allocate memory")


def _is_out_of_memory(e: BaseException) -> bool:
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _CPU_MESSAGES)


@contextlib.contextmanager
def refuse_out_of_memory(what: str, nbytes: int, device: torch.device | str, fix: str) -> Iterator[None]:
    """Allocate ``what`` (``nbytes`` on ``device``) here: running out of memory is an
    ``InvalidArgumentError`` naming it and ``fix`` (the sizes to lower), chained to
    torch's error. Any other error passes through unchanged."""
    if nbytes >= 1 << 63:
        # torch cannot even express such a size (its sizes are int64): say which sizes to lower.
        raise InvalidArgumentError(f"cannot allocate {what}: {nbytes} bytes on {device} is past 2**63, "
                                   f"more than any device holds; {fix}")
    try:
        yield
    except Exception as e:
        if not _is_out_of_memory(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InvalidArgumentError(
            f"cannot allocate {what}: {nbytes} bytes on {device} ({first[:200]}); {fix}") from e
