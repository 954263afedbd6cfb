"""Argument checks for the pool's writes and reads, all done before any store.

Each check raises a typed error naming what was wrong and what would be
right. Slot values are checked on the host only: for slots already on a CUDA
device, reading them back would sync the device on the hot path, so there only
dtype, shape and device are checked (the store kernel skips negative slots, and
slots from ``KVPool.extend`` are valid by construction).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

from kvpool._eager import eager_only
from kvpool._values import host_array, is_int
from kvpool.errors import (
    DuplicateSlotError,
    InvalidArgumentError,
    LayerIndexError,
    ReservedSlotError,
    SlotRangeError,
    TensorDeviceError,
    TensorDtypeError,
    TensorShapeError,
)
from kvpool.kernels._common import check_dense
from kvpool.kernels._guard import on_device
from kvpool.torch_types import INDEX_DTYPES

__all__ = ["check_flag", "check_layer", "check_rows", "host_array", "init_signature", "is_int", "slots_tensor"]


def init_signature(cls: type, **annotations: str) -> inspect.Signature:
    """``cls.__init__``'s parameters without ``self`` (some annotations replaced), as
    ``cls.__signature__`` of a class whose ``__new__`` takes ``*args, **kwargs`` only to route
    some calls to another class: else help() and inspect show that ``__new__``'s."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # type: ignore[misc]
    return inspect.Signature([p.replace(annotation=annotations.get(p.name, p.annotation)) for p in params])


def check_flag(name: str, value: Any) -> bool:
    """A keyword flag: True or False (numpy bools included), never a truthiness guess."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise InvalidArgumentError(f"{name} takes True or False, got {type(value).__name__} {value!r}")


def check_pool(pool: Any, what: str, needs: tuple[str, ...] = ("allocator", "device")) -> None:
    """Refuse what is not a pool up front (else an AttributeError from deep inside ``what``)."""
    if any(getattr(pool, name, None) is None for name in needs):
        raise InvalidArgumentError(f"{what} takes a KVPool, got {type(pool).__name__} {pool!r:.80}")


def require_plain_pool(pool: Any, what: str) -> None:
    """Refuse anything but a plain ``KVPool`` with a typed error: a hybrid pool (its
    ``groups``) has no single page geometry (nor a host tier), and a wrong object would
    otherwise fail later with an AttributeError, after a caller's state had changed."""
    if getattr(pool, "groups", None) is not None or any(
            getattr(pool, name, None) is None for name in ("allocator", "device", "page_size")):
        raise InvalidArgumentError(f"{what} needs a plain kvpool.KVPool (no layer_types), got {type(pool).__name__}")


def check_layer(layer: Any, num_layers: int) -> int:
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise LayerIndexError(f"layer must be an int in [0, {num_layers}), got {type(layer).__name__}")
    if not 0 <= layer < num_layers:
        raise LayerIndexError(f"layer {layer} is out of range: the pool has layers [0, {num_layers})")
    return int(layer)


def check_rows(name: str, x: Any, n: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
    """``x`` must be a dense ``dtype`` tensor of shape ``[n, heads, dim]`` on ``device``."""
    if not isinstance(x, torch.Tensor):
        raise TensorDtypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    check_dense(x, name)
    if x.dtype != dtype:
        raise TensorDtypeError(f"{name} has dtype {x.dtype}; this pool takes {dtype} (no silent casts)")
    if tuple(x.shape) != (n, heads, dim):
        raise TensorShapeError(
            f"{name} has shape {list(x.shape)}; expected [{n}, {heads}, {dim}] "
            "(one row per slot, [num_kv_heads, head_dim] each)"
        )
    if x.device != device:
        raise TensorDeviceError(f"{name} is on {x.device}; the pool is on {device}")


def _out_of_range(bad: int, value: int, num_slots: int) -> SlotRangeError:
    return SlotRangeError(
        f"slots[{bad}] = {value} is out of range: valid slots are [0, {num_slots}) "
        "(negative slots are padding and are skipped)"
    )


def refuse_bools_in(name: str, values: list[Any] | tuple[Any, ...], why: str) -> None:
    """``TensorDtypeError`` naming the first bool of a list of ints (which numpy would take as
    0 or 1); one C-speed pass over the types."""
    kinds = set(map(type, values))
    if bool in kinds or np.bool_ in kinds:
        bad = next(i for i, x in enumerate(values) if isinstance(x, (bool, np.bool_)))
        raise TensorDtypeError(f"{name}[{bad}] is the bool {values[bad]!r}, {why}")
    if torch.Tensor in kinds or np.ndarray in kinds:  # (a 0-d bool tensor or array: numpy takes it as 0 or 1 too)
        for i, x in enumerate(values):
            if isinstance(x, (torch.Tensor, np.ndarray)) and x.dtype in (torch.bool, np.bool_):
                raise TensorDtypeError(f"{name}[{i}] is a bool {type(x).__name__} ({x!r}), {why}")


def _as_tensor(slots: Any, num_slots: int) -> torch.Tensor:
    if isinstance(slots, torch.Tensor):
        return slots
    arr = host_array("slots", slots)
    if arr.dtype.kind in "fO" and isinstance(slots, (list, tuple)):
        # Python ints past int64 make numpy pick float64 / object: name the slot.
        for i, x in enumerate(slots):
            if isinstance(x, int) and not isinstance(x, bool) and not -(2**63) <= x < 2**63:
                raise _out_of_range(i, x, num_slots)
    if arr.dtype.kind in "iu" and isinstance(slots, (list, tuple)):
        # numpy makes [True, 3] ints, and True would name slot 1 (a real page at page size 1).
        refuse_bools_in("slots", slots, "not a slot: pass ints (int32/int64); a bool is never a slot id")
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            arr = arr.astype(np.int64)
        else:
            raise TensorDtypeError(f"slots must be integers (int32/int64), got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        # astype(int64) would wrap these to negative ids, which mean padding.
        bad = int(np.argmax(arr > np.iinfo(np.int64).max))
        raise _out_of_range(bad, int(arr.reshape(-1)[bad]), num_slots)
    if arr.dtype not in (np.int32, np.int64):
        arr = arr.astype(np.int64)
    elif not arr.flags.writeable:
        # (np.frombuffer of received bytes, a shared-memory view): torch.from_numpy warns
        # about every such array, though the pool only reads the slots; a copy is silent.
        arr = arr.copy()
    return torch.from_numpy(np.ascontiguousarray(arr))


def slots_tensor(
    slots: Any, device: torch.device, num_slots: int, page_size: int, *, strict: bool
) -> tuple[torch.Tensor, bool]:
    """Slots as an int32/int64 tensor usable on ``device``, and whether any is negative.

    Host slots are rejected while a CUDA graph is being captured on ``device``
    (their copy cannot be captured); otherwise they are range-checked:
    ``slot < num_slots`` always; with ``strict`` also ``slot >= page_size``
    (page 0 is the padding sink, never a real token), no negatives and no
    repeats. Device slots are returned unchecked (see module doc) and
    ``has_negative`` is then reported as True (unknown without a read-back).
    """
    if torch.compiler.is_compiling():
        # Under torch.compile the value checks run eagerly (one clean graph
        # break) instead of tracing data-dependent branches. Eager callers skip
        # the disable() wrapper, which costs ~2 us a call (and is made on first
        # use: kvpool._eager).
        return _slots_tensor_eager(slots, device, num_slots, page_size, strict=strict)
    return _slots_tensor(slots, device, num_slots, page_size, strict=strict)


def _slots_tensor(
    slots: Any, device: torch.device, num_slots: int, page_size: int, *, strict: bool
) -> tuple[torch.Tensor, bool]:
    t = _as_tensor(slots, num_slots)
    if t.dtype not in INDEX_DTYPES:
        raise TensorDtypeError(f"slots have dtype {t.dtype}; expected torch.int32 or torch.int64")
    if t.dim() != 1:
        raise TensorShapeError(f"slots must be 1-D [n], got shape {list(t.shape)}")
    if t.device.type != "cpu":
        if t.device != device:
            raise TensorDeviceError(f"slots are on {t.device}; the pool is on {device} (host slots are also fine)")
        return t, True
    if device.type == "cuda" and _capturing(device):
        raise TensorDeviceError(
            f"slots are on the host while a CUDA graph is being captured on {device}: the "
            "host -> device copy they need cannot be captured (and a replay would reuse stale "
            "values). Pass the slots as a device tensor, e.g. ExtendResult.out_cache_loc or "
            "the runner's static out_cache_loc; host slots are fine outside capture"
        )
    if t.numel() == 0:
        return t, False
    lo, hi = (int(x) for x in torch.aminmax(t))
    if hi >= num_slots:
        bad = int(torch.nonzero(t >= num_slots)[0, 0])
        raise _out_of_range(bad, int(t[bad]), num_slots)
    if strict and lo < page_size:
        bad = int(torch.nonzero(t < page_size)[0, 0])
        raise ReservedSlotError(
            f"slots[{bad}] = {int(t[bad])} is padding (negative) or in the reserved page 0 "
            f"(slots [0, {page_size})), but strict=True says every row is a real token; "
            "slots from KVPool.extend are always >= page_size"
        )
    if strict and t.numel() > 1:
        uniq, counts = torch.unique(t, return_counts=True)
        if bool((counts > 1).any()):
            raise DuplicateSlotError(
                f"slot {int(uniq[counts > 1][0])} appears more than once, but strict=True says "
                "every row is a distinct real token (a repeated slot keeps one of its rows, "
                "which one is unspecified); slots from KVPool.extend never repeat"
            )
    return t, lo < 0


def _capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph."""
    with on_device(device):
        return torch.cuda.is_current_stream_capturing()


_slots_tensor_eager: Any = eager_only(globals(), "_slots_tensor_eager", _slots_tensor)
