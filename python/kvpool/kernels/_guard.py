"""Make a tensor's CUDA device current around a launch.

Triton launches on the current device's current stream, and torch's
``torch.cuda.graph`` / ``current_stream()`` default to the current device too:
a pool on ``cuda:1`` called while ``cuda:0`` is current would otherwise launch
its kernels on the wrong device. The check costs one ``current_device()`` call;
the switch happens only when the device differs.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

__all__ = ["on_device"]

_NULL = contextlib.nullcontext()

# A tensor on ``device`` exists, so CUDA is initialised: read the current device without
# torch.cuda.current_device()'s lazy-init wrapper (measured ~1 µs of a launch's host time).
try:
    _current_device = torch._C._cuda_getDevice
except AttributeError:  # pragma: no cover - a torch built without CUDA
    _current_device = torch.cuda.current_device


def on_device(device: torch.device) -> AbstractContextManager:
    """``torch.cuda.device(device)`` when ``device`` is a CUDA device other than the
    current one; a no-op context otherwise (CPU, or already current)."""
    if device.type != "cuda" or device.index is None:
        return _NULL
    if device.index == _current_device():
        return _NULL
    return torch.cuda.device(device.index)
