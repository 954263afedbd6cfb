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

__all__ = ["current_device", "on_device"]

_NULL = contextlib.nullcontext()

_TORCH_CURRENT_DEVICE = torch.cuda.current_device


def current_device() -> int:
    """torch.cuda.current_device(), without its lazy-init wrapper once CUDA is initialised
    (~1 µs of an eager launch's host time); a replaced torch.cuda.current_device (the
    tests' fake devices) is called as it is."""
    get = torch.cuda.current_device
    if get is _TORCH_CURRENT_DEVICE and torch.cuda._initialized:
        return torch._C._cuda_getDevice()
    return get()


def on_device(device: torch.device) -> AbstractContextManager:
    """``torch.cuda.device(device)`` when ``device`` is a CUDA device other than the
    current one; a no-op context otherwise (CPU, or already current)."""
    if device.type != "cuda" or device.index is None:
        return _NULL
    if device.index == current_device():
        return _NULL
    return torch.cuda.device(device.index)


def capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph (never for a
    non-CUDA device, where torch may have no CUDA runtime to ask). Here, below the pool,
    so that the kernels' own transfers ask it too (``kvpool.streams`` re-exports it)."""
    if device.type != "cuda":
        return False
    with on_device(device):
        return torch.cuda.is_current_stream_capturing()
