"""Typed errors of the torch layer.

Argument errors derive from ``InvalidArgumentError`` (itself a ``KVPoolError``
and a ``ValueError``); ``TritonUnavailableError`` (an install problem, not a bad
argument) is a ``KVPoolError`` and a ``RuntimeError``. So engines can catch one
base class. All are raised before anything is written, so a failed call leaves
the pool exactly as it was.
"""

from __future__ import annotations

from kvpool._core import InvalidArgumentError, KVPoolError

__all__ = [
    "LayerIndexError",
    "ReservedSlotError",
    "SlotRangeError",
    "TensorDeviceError",
    "TensorDtypeError",
    "TensorShapeError",
    "TritonUnavailableError",
]


class TensorShapeError(InvalidArgumentError):
    """A tensor argument has the wrong shape (or the wrong number of rows)."""


class TensorDtypeError(InvalidArgumentError):
    """A tensor argument has the wrong dtype."""


class TensorDeviceError(InvalidArgumentError):
    """A tensor argument lives on a different device than the pool."""


class SlotRangeError(InvalidArgumentError):
    """A slot id is >= num_slots (negative ids are padding and are skipped)."""


class ReservedSlotError(SlotRangeError):
    """A slot in the reserved page 0 was given to a strict write (no padding expected)."""


class LayerIndexError(InvalidArgumentError):
    """A layer index is outside ``[0, num_layers)``."""


class TritonUnavailableError(KVPoolError, RuntimeError):
    """K/V must move on a CUDA device but Triton cannot be imported; the message says what to install."""
