"""Where the pool's device work goes, and what it must never do: the stream contract.

Everything a pool call enqueues (the H2D copies from the pinned ring, the table
kernel, copy-on-write copies) goes on the caller's current stream of the pool's
device. Two rules follow, kept here:

- ``refuse_capture``: a call that would stage host data must not run while that
  stream is capturing a CUDA graph. The ring records an event after each copy,
  and an event recorded inside a capture poisons every later ``query()``
  (cudaErrorCapturedEvent), so the call is refused before the core changes
  anything.
- ``CopyOrder``: a copy-on-write copy reads a page that its extend has just let
  go of. Once the pool's lock is released another thread may free that page and
  hand it out again, and its new owner may write it from another stream. The
  pool therefore records an event after the copies, and every later call that
  can hand out pages makes its caller's stream wait for that event when it is a
  different stream (``wait_event``: the device waits, the host does not).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvpool.errors import TensorDeviceError
from kvpool.kernels._guard import capturing, current_device
from kvpool.kernels.launch import raw_stream

__all__ = ["CopyOrder", "capturing", "current_raw_stream", "refuse_capture"]


def current_raw_stream(device: torch.device) -> int:
    """The raw handle of CUDA ``device``'s current stream: what to compare once per step or copy,
    where ``torch.cuda.current_stream()`` would make a new Stream object each time."""
    return raw_stream(current_device() if device.index is None else device.index)


def refuse_capture(device: torch.device, what: str) -> None:
    """Raise ``TensorDeviceError`` if a CUDA graph is being captured on ``device``."""
    if capturing(device):
        raise TensorDeviceError(
            f"{what} was called while a CUDA graph is being captured on {device}: it copies host "
            "data to the device through the pool's pinned ring, which cannot be captured (the "
            "ring's event would poison the pool). Call it before capture or between replays; "
            "inside the captured step pass device tensors (ExtendResult.out_cache_loc, the "
            "runner's static buffers). Nothing was changed"
        )


class CopyOrder:
    """Orders the pool's copy-on-write copies (and ``DiskCache``'s loads into pages it
    publishes) before later work on other streams.

    One event serves every stream: each call that hands out pages first makes
    its stream wait for the last record, and only then may copy and record
    again, so the latest record also covers every earlier copy. Callers hold
    the pool's lock around both methods.

    ``wait`` runs at the start of every extend once a copy was made: it tells streams
    apart by their raw handles, and makes a torch Stream object (``current_stream()``,
    ~4 µs of host time on a GPU box, a new object at every call) only when that stream
    must wait.

    Args:
        device: the pool's CUDA device.
        make_event, current_stream: event and stream factories (tests inject fakes); an
            injected ``current_stream``'s objects are also what streams are told apart by.
    """

    def __init__(self, device: torch.device, *, make_event: Callable[[], Any] | None = None,
                 current_stream: Callable[[], Any] | None = None) -> None:
        self._make_event = make_event or torch.cuda.Event
        self._current = current_stream or (lambda: torch.cuda.current_stream(device))
        self._key: Callable[[], Any] = current_stream or (lambda: current_raw_stream(device))
        self._event: Any = None
        self._stream: Any = None  # the key of the stream the event was last recorded on
        self._waited: list[Any] = []  # keys of the streams already waiting for the current record

    def copied(self) -> None:
        """Record, on the caller's current stream, that the copies enqueued so far are done."""
        stream = self._current()
        if self._event is None:
            self._event = self._make_event()
        self._event.record(stream)
        self._stream = self._key()
        self._waited.clear()

    def wait(self) -> None:
        """Make the caller's current stream wait for the last recorded copies (if another stream's)."""
        if self._event is None:
            return
        key = self._key()
        if key == self._stream or key in self._waited:
            return
        self._current().wait_event(self._event)
        self._waited.append(key)
