"""The checks a ``DecodeGraphRunner`` step's inputs pass before any buffer is touched.

Host inputs become int64 numpy arrays with every value a typed error would name
refused here (slots past the pool, rows outside ``req_to_token``, token ids,
positions and lengths the tables cannot index); device inputs are checked for
dtype, shape and device only (checking their values would sync the device).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvpool._core import InvalidArgumentError
from kvpool.errors import SlotRangeError, TensorDeviceError, TensorDtypeError, TensorShapeError
from kvpool.kernels._common import check_dense
from kvpool.torch_types import INT_DTYPES
from kvpool.validate import refuse_bools_in

__all__ = ["INPUT_NAMES", "apart_from", "check_inputs"]

# Rows of the static [5, max_bucket] int64 input buffer, in step() argument order.
INPUT_NAMES = ("input_ids", "positions", "req_rows", "out_cache_loc", "seq_lens")

_I64 = np.iinfo(np.int64)


def _too_big(name: str, i: int, value: int, num_slots: int | None) -> InvalidArgumentError:
    if name == "out_cache_loc":
        valid = f"[0, {num_slots})" if num_slots is not None else "the pool's slots"
        return SlotRangeError(
            f"out_cache_loc[{i}] = {value} is out of range: valid slots are {valid} "
            "(negative slots are padding: their write is skipped)"
        )
    return InvalidArgumentError(
        f"{name}[{i}] = {value} does not fit in int64, the dtype of the step's inputs"
    )


def _host_ints(name: str, a: Any, num_slots: int | None) -> np.ndarray:
    """A host input as a 1-D int64 array, or a typed error: never a silently wrapped value."""
    if isinstance(a, torch.Tensor):
        if a.dtype not in INT_DTYPES:
            raise TensorDtypeError(f"{name} must be integers, got {a.dtype}")
        arr = a.detach().numpy()
    else:
        try:
            arr = np.asarray(a)
        except (TypeError, ValueError, OverflowError) as e:
            raise TensorDtypeError(f"{name} must be a 1-D sequence of integers: {e}") from None
        if arr.dtype.kind in "fO" and isinstance(a, (list, tuple)):
            # Python ints past int64 make numpy pick float64 or object: name the entry.
            for i, x in enumerate(a):
                if isinstance(x, int) and not isinstance(x, bool) and not _I64.min <= x <= _I64.max:
                    raise _too_big(name, i, x, num_slots)
        if arr.dtype.kind in "iu" and isinstance(a, (list, tuple)):
            # numpy makes [0, True] ints, and True would name row or slot 1 (KVPool.write's rule).
            refuse_bools_in(name, a, "not an int: pass ints; a bool is never a step input")
    if arr.ndim != 1:
        raise TensorShapeError(f"{name} must be 1-D, got shape {list(arr.shape)}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise TensorDtypeError(f"{name} must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _I64.max:
        bad = int(np.argmax(arr > _I64.max))
        raise _too_big(name, bad, int(arr[bad]), num_slots)
    arr = np.ascontiguousarray(arr, dtype=np.int64)  # (a reversed view: torch.from_numpy refuses negative strides)
    if name == "out_cache_loc" and num_slots is not None and int(arr.max()) >= num_slots:
        bad = int(np.argmax(arr >= num_slots))
        raise _too_big(name, bad, int(arr[bad]), num_slots)
    return arr


def _check_rows(arr: np.ndarray, null_row: int) -> None:
    """Host ``req_rows`` name rows of ``req_to_token``, ``[0, null_row]``: a step indexing it with
    another value reads a wrong row (a negative one counts from the end) or past the table."""
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > null_row):
        bad = int(np.argmax((arr < 0) | (arr > null_row)))
        raise InvalidArgumentError(
            f"req_rows[{bad}] = {int(arr[bad])} is not a row of the pool's req_to_token: valid rows "
            f"are [0, {null_row}] (request rows, and null_row = {null_row} for padding)"
        )


def _check_values(name: str, arr: np.ndarray, max_context_len: int | None) -> None:
    """Host values the step would use as indices: a negative token id, or a position or
    sequence length past the pool's rows, makes the step read outside its tables (on a
    GPU a device-side assert or an illegal access, which ends the process's CUDA
    context), so they are refused here, where it costs a min and a max."""
    if not arr.size:
        return
    if name == "input_ids":
        lo, hi, valid = 0, None, "token ids are >= 0"
    elif name in ("positions", "seq_lens") and max_context_len is not None:
        top = max_context_len - 1 if name == "positions" else max_context_len
        lo, hi, valid = 0, top, f"valid {name} are [0, {top}] (the pool's max_context_len is {max_context_len})"
    else:
        return
    bad_mask = arr < lo
    if hi is not None:
        bad_mask |= arr > hi
    if bad_mask.any():
        bad = int(np.argmax(bad_mask))
        raise InvalidArgumentError(f"{name}[{bad}] = {int(arr[bad])} is out of range: {valid}")


def check_inputs(args: Sequence[Any], device: torch.device, num_slots: int | None, null_row: int,
                 max_context_len: int | None, max_batch_size: int) -> tuple[int, list[Any]]:
    """A step's five inputs checked before the runner touches any buffer: host inputs become int64 numpy arrays
    (values checked), device inputs stay tensors (dtype, shape and device checked)."""
    out: list[Any] = []
    lens = []
    for name, a in zip(INPUT_NAMES, args):
        if isinstance(a, torch.Tensor):
            check_dense(a, name)
        if isinstance(a, torch.Tensor) and a.device.type != "cpu":
            if a.dim() != 1:
                raise TensorShapeError(f"{name} must be 1-D, got shape {list(a.shape)}")
            if a.numel() and a.dtype not in INT_DTYPES:
                raise TensorDtypeError(f"{name} must be integers, got {a.dtype}")
            if a.dtype == torch.uint64:
                raise TensorDtypeError(
                    f"{name} is a uint64 device tensor: values past int64 would wrap (2**64 - 1 "
                    "becomes -1) and checking them would sync the device; pass int64"
                )
            if a.device != device:
                raise TensorDeviceError(f"{name} is on {a.device}, the pool on {device}")
            out.append(a)
        else:
            out.append(_host_ints(name, a, num_slots))
            if name == "req_rows":
                _check_rows(out[-1], null_row)
            else:
                _check_values(name, out[-1], max_context_len)
        lens.append(out[-1].shape[0])
    n = lens[0]
    if any(x != n for x in lens):
        raise TensorShapeError(f"inputs must have equal lengths, got {dict(zip(INPUT_NAMES, lens))}")
    if n < 1:
        raise InvalidArgumentError("empty batch: nothing to run")
    if n > max_batch_size:
        raise InvalidArgumentError(f"batch of {n} exceeds max_batch_size {max_batch_size}")
    return n, out


def apart_from(static: torch.Tensor, args: list[Any]) -> list[Any]:
    """``args`` with copies of those that share memory with ``static`` (the views a step was
    handed, passed back as another input): the load writes the buffer's rows in turn, and would
    read such an input after its row was overwritten. A pointer test, about 0.1 µs a tensor
    (host arrays are looked at only for a CPU pool: they cannot alias device memory, and
    reading a numpy array's address costs a microsecond)."""
    lo = static.data_ptr()
    hi = lo + static.numel() * static.element_size()
    host = not static.is_cuda
    out = args
    for i, a in enumerate(args):
        p = (a.data_ptr() if isinstance(a, torch.Tensor)
             else a.ctypes.data if host and isinstance(a, np.ndarray) else None)
        if p is not None and lo <= p < hi:
            if out is args:
                out = list(args)
            out[i] = a.clone() if isinstance(a, torch.Tensor) else a.copy()
    return out
