"""Checks of plain values (ints, sequences of ints) that need neither torch nor a pool.

Here, in the base layer, so that the parts of kvpool a router or a monitoring process
uses without torch (``kvpool.router``, ``kvpool.events``) can share them with the pool's
checks (``kvpool.validate`` re-exports both).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.errors import TensorShapeError

__all__ = ["host_array", "is_int"]


def is_int(x: Any) -> bool:
    """An int or numpy integer, not a bool (True is an int to Python, never a count here)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def host_array(name: str, x: Any) -> np.ndarray:
    """``np.asarray(x)``, with a ragged sequence (rows of different lengths, which
    numpy refuses) reported as a ``TensorShapeError`` naming ``name``."""
    try:
        return np.asarray(x)
    except ValueError as e:
        raise TensorShapeError(f"{name} must be a flat (1-D) sequence of ints, got a ragged "
                               f"{type(x).__name__} ({e})") from None
