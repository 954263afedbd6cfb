"""The two ways a pool's rows reach its caches on the host side: the core's row copy
(``scatter_into``: one ``memcpy`` a row) and torch's ``index_copy_`` (``index_copy_rows``),
for sources the row copy does not take, under ``torch.compile`` and dispatch modes.

Split from ``rows`` (which re-exports both): ``rows`` checks a call's arguments once,
these only move the bytes.
"""

from __future__ import annotations

import torch

from kvpool._core import scatter_rows
from kvpool.kernels._common import readable, views_of

__all__ = ["index_copy_rows", "scatter_into"]


def index_copy_rows(caches: tuple[torch.Tensor, ...], idx: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor | None) -> None:
    """``caches[0][idx] = k`` (and ``caches[1][idx] = v``) with ``index_copy_``.

    Rows that are views of the caches themselves (a caller moving rows within a layer)
    are stored as they were when the call was made: ``index_copy_`` refuses a source
    whose memory overlaps its destination, before it writes, so such a source is copied
    out and the store run again (a K copy that went through did not overlap the K cache,
    so storing it again stores the same values). Rows with no storage to read (a DTensor,
    a tensor batched by ``torch.func.vmap``) are refused before K is stored, else V's copy
    would fail after it. While torch.compile traces, the refused copy would be traced into
    the graph, where no except runs, and under a dispatch mode ``make_fx`` would record
    it: there the overlap is asked first (compiling: both copied out, a step's new rows).
    """
    if torch.compiler.is_compiling():
        k = k.clone()
        v = None if v is None else v.clone()
    elif _dispatch_modes():
        if views_of(caches, k):
            k = k.clone()
        if views_of(caches, v):
            v = v.clone()
    else:
        readable(k)
        if v is not None:
            readable(v)
        try:
            caches[0].index_copy_(0, idx, k)
            if v is not None:
                caches[1].index_copy_(0, idx, v)
            return
        except RuntimeError:
            if not (views_of(caches, k) or views_of(caches, v)):
                raise
            k = k.clone()
            v = None if v is None else v.clone()
    caches[0].index_copy_(0, idx, k)
    if v is not None:
        caches[1].index_copy_(0, idx, v)


def scatter_into(caches: tuple[torch.Tensor, ...], idx: torch.Tensor, src: tuple[torch.Tensor, ...]) -> bool:
    """``caches[j][idx] = src[j]`` as one ``memcpy`` a row in the core (``_core.scatter_rows``:
    padding skipped, every slot checked before any write, IndexError if one is out of
    range); False, with nothing done, for tensors it does not take (a subclass, a
    non-contiguous source, another device), while torch.compile traces (a native
    call would break the graph) and while a TorchDispatchMode is active (make_fx and
    export record the store in their graph, FakeTensorMode and profilers see it, rather
    than a memcpy into the real cache behind their backs): the caller then stores with
    torch.

    ``index_copy_`` walks a bf16 row element by element and costs ~3x this at 64 rows
    of 8 x 128. The caches' version counters are bumped as an in-place torch op would
    bump them, so autograd still refuses a backward through a cache view saved before
    the write.
    """
    if torch.compiler.is_compiling() or _dispatch_modes() or scatter_rows(caches, idx, src) < 0:
        return False
    _increment_version(caches)
    return True


_increment_version = torch._C._increment_version
_dispatch_modes = torch._C._len_torch_dispatch_stack  # counts make_fx's and fake-tensor infra modes too
