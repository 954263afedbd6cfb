"""What a ``DecodeGraphRunner`` step returned, cut from its bucket's padded batch to the real
rows (``kvpool.cuda_graph``'s ``run``): tensors and the containers engines return them in."""

from __future__ import annotations

import copy as copy_module
import dataclasses
from typing import Any

import torch

from kvpool._core import InvalidArgumentError

__all__ = ["slice_rows"]


def slice_rows(out: Any, n: int, copy: bool = False) -> Any:
    """``out`` (a tensor, or tuples, lists, dicts, namedtuples and dataclasses of them) cut to its
    first ``n`` rows (``copy``: cloned), as ``DecodeGraphRunner.run`` returns a bucket's output."""
    if isinstance(out, torch.Tensor):
        if out.dim() == 0:  # no rows: a value over the whole bucket, padded rows included
            raise InvalidArgumentError("the step returned a 0-d tensor, which has no rows to cut to the real "
                                       "batch (it would count the bucket's padded rows): return per-row tensors, "
                                       "dim 0 the batch, and reduce over the first n rows after run()")
        return out[:n].clone() if copy else out[:n]
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # a namedtuple takes its fields one by one
        return type(out)(*(slice_rows(o, n, copy) for o in out))
    if isinstance(out, (tuple, list)):
        return type(out)(slice_rows(o, n, copy) for o in out)
    if isinstance(out, dict):  # else the bucket's padded rows would come back as requests
        sliced = copy_module.copy(out)
        for k, v in out.items():
            sliced[k] = slice_rows(v, n, copy)
        return sliced
    if dataclasses.is_dataclass(out) and not isinstance(out, type):  # the same, field by field
        return dataclasses.replace(out, **{f.name: slice_rows(getattr(out, f.name), n, copy)
                                           for f in dataclasses.fields(out) if f.init})
    return out
