"""Handles arguments converted once, before the core commits.

The pool reads a call's ``handles`` again after the core's call has changed it
(``RowEdits._note_edit``, ``swap_in``'s table rows). When the argument carries its own
Python code (an element's ``__index__``, an object's ``__array__``), a second run may
raise or answer differently after the pool changed, where docs/errors.md promises a
refusal that leaves the pool as it was. ``frozen_handles`` runs that code once, up
front, and hands the core and the pool the same plain values.
"""

from __future__ import annotations

import operator
import sys
from typing import Any

import numpy as np

from kvpool._core import InvalidArgumentError

__all__ = ["frozen_handles"]

# Converted by the core without running any code of the caller's.
_PLAIN = (int, float, complex, str, bytes, np.generic, np.ndarray, type(None))


def _plain(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return isinstance(x, _PLAIN) or (torch is not None and isinstance(x, torch.Tensor))


def _index(x: Any) -> Any:
    """``x`` itself when plain or not int-like (the core refuses it with its own error),
    else its ``__index__`` run once."""
    if _plain(x) or not hasattr(type(x), "__index__"):
        return x
    try:
        return operator.index(x)
    except MemoryError:
        raise
    except Exception as e:  # (a BaseException that is not an Exception reaches the caller as it is)
        raise InvalidArgumentError(
            f"handles must be ints; converting {type(x).__name__} with its __index__ raised "
            f"{type(e).__name__}: {e}") from e


def frozen_handles(handles: Any) -> Any:
    """``handles`` with the caller's conversion code run once: a list or tuple of ints as
    one int64 array (which the pool's reads after the core then copy cheaply), int-like
    elements as ints, an object with ``__array__`` as its array, an int-like object as its
    int. Plain ints, numpy arrays, tensors and other sequences come back as they are, and
    so does what the core refuses anyway (floats, bools, a ragged list), for its own error.

    Raises:
        InvalidArgumentError: that code raised an ``Exception`` (a ``MemoryError`` or a
            ``BaseException`` that is not an ``Exception`` is raised as it is).
    """
    if isinstance(handles, (list, tuple)):
        try:
            arr = np.asarray(handles)
        except MemoryError:
            raise
        except Exception:  # (ragged: the core refuses it, before anything changes)
            return handles
        if arr.dtype.kind in "iu":
            return arr
        if arr.dtype == object:  # elements numpy would not read: int-likes, ints past int64
            return [_index(h) for h in handles]
        return handles
    if _plain(handles):
        return handles
    if hasattr(type(handles), "__array__"):
        try:
            return np.asarray(handles)
        except MemoryError:
            raise
        except Exception as e:
            raise InvalidArgumentError(
                f"handles must be ints or an integer array; converting {type(handles).__name__} "
                f"with its __array__ raised {type(e).__name__}: {e}") from e
    return _index(handles)
