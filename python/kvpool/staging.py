"""Pinned host staging for the pool's host -> device copies.

A non-blocking copy from pageable host memory is not truly asynchronous: the
CUDA driver first stages the bytes into its own pinned buffer and may
synchronise with the stream to do so, which breaks "no pool call syncs the
device". From pinned memory the copy is a plain DMA queued on the stream.

The pool therefore packs each update into a ring of pinned buffers. A buffer
may be refilled only once the copy that read it has run: an event recorded
after that copy says so. When the next buffer is still in use (the host runs
ahead of the GPU), the ring grows by one buffer instead of waiting; only past
``max_depth`` buffers does it wait for the oldest copy (back-pressure on a
host that is hundreds of copies ahead). Each buffer grows to the largest
update it has carried, in powers of two, so steady state allocates nothing.

``to_device`` and ``pool_to_device`` are the one way the torch layer moves
host arrays to its device: zero copy on CPU, through the pool's ring on CUDA.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvpool._forksafe import INNER
from kvpool._forksafe import track as track_for_fork
from kvpool.modes import persistent
from kvpool.packed import pack, unpack
from kvpool.streams import current_raw_stream

__all__ = ["PinnedRing", "ToDevice", "pool_to_device", "to_device"]

#: A host -> device copy function: ``PinnedRing.to_device`` of a CUDA pool.
ToDevice = Callable[[np.ndarray], torch.Tensor]


def to_device(host: np.ndarray, device: torch.device, ring: ToDevice | None = None) -> torch.Tensor:
    """``host`` as a tensor on ``device``, without waiting for the device.

    On CPU the tensor shares ``host``'s memory (no copy). Elsewhere one
    non-blocking copy on the current stream: through ``ring`` (a pool's
    ``PinnedRing.to_device``) when given, else straight from ``host`` (pageable
    memory, which the driver may synchronise to stage: pools always pass their ring).
    """
    if ring is not None:
        return ring(host)
    src = torch.from_numpy(host)
    return src if device.type == "cpu" else src.to(device, non_blocking=True)


def pool_to_device(pool: Any, *parts: np.ndarray) -> list[torch.Tensor]:
    """Several int64 host arrays on ``pool.device`` with ONE copy, through the
    pool's ring (``pool._to_device``) on CUDA; views of the copied buffer.

    Packed by ``kvpool.packed.pack``: each part starts on a 16-byte boundary, so
    Triton sees the same pointer alignment whatever the batch sizes are.
    """
    packed, starts = pack(parts)
    dev = to_device(packed, pool.device, getattr(pool, "_to_device", None))
    return unpack(dev, starts, [len(p) for p in parts])


def _pinned(nbytes: int) -> torch.Tensor:
    with persistent():
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)


class _Slot:
    __slots__ = ("buf", "event", "busy", "_typed")

    def __init__(self, buf: torch.Tensor, event: Any) -> None:
        self.event, self.busy = event, False
        self.grow(buf)

    def grow(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self._typed: dict[np.dtype, tuple[torch.Tensor, np.ndarray]] = {}

    def fill(self, host: np.ndarray) -> torch.Tensor:
        """``host`` (contiguous) copied into this buffer, as a tensor of its dtype and shape.

        Through a numpy view of the buffer kept per dtype: a per-call ``buf[:n].view(dtype)``,
        ``torch.from_numpy`` and ``copy_`` cost a device ``extend`` ~5 µs of host time a step
        on the Xeon VM, the numpy copy and one slice ~2.5. (The buffer is the ring's own: no
        caller sees it on a CUDA pool, so torch's version counter, which a numpy write does
        not move, guards nothing here.)"""
        typed = self._typed.get(host.dtype)
        if typed is None:
            usable = self.buf.numel() // host.itemsize * host.itemsize
            with persistent():  # (made once, maybe under inference mode: a normal view)
                flat = self.buf[:usable].view(torch.from_numpy(host[:0].reshape(-1)).dtype)
            typed = self._typed[host.dtype] = (flat, flat.numpy())
        flat, arr = typed
        n = host.size
        arr[:n] = host.reshape(-1)
        staged = flat[:n]
        return staged if host.ndim == 1 else staged.view(host.shape)


class PinnedRing:
    """Host arrays -> device tensors through pinned buffers, without device syncs.

    Args:
        device: the CUDA device the copies go to.
        min_bytes: initial size of each buffer.
        max_depth: most buffers in flight before ``to_device`` waits for the oldest.
        alloc, make_event: pinned-buffer and event factories (tests inject fakes).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        min_bytes: int = 1 << 14,
        max_depth: int = 64,
        alloc: Callable[[int], torch.Tensor] = _pinned,
        make_event: Callable[[], Any] | None = None,
    ) -> None:
        self.device = device
        self.min_bytes, self.max_depth = int(min_bytes), int(max_depth)
        self._alloc = alloc
        self._make_event = make_event or torch.cuda.Event
        self._slots: list[_Slot] = []
        self._next = 0
        # The current stream's torch object and raw handle, kept while that stream stays current:
        # torch.cuda.current_stream() makes a new Stream object at every call, ~4 µs of a device
        # extend's host time on the H200 box, where the raw handle costs a fraction of that.
        self._stream: Any = None
        self._raw: int | None = None
        self._lock = threading.Lock()
        track_for_fork(self, "_lock", INNER)  # a forked child's first copy would wait on it

    @property
    def depth(self) -> int:
        """Buffers the ring holds (grows while the host runs ahead of the GPU)."""
        return len(self._slots)

    def _free_slot(self, nbytes: int) -> _Slot:
        n = len(self._slots)
        for i in range(n):  # oldest first, starting after the last one used
            s = self._slots[(self._next + i) % n]
            if not s.busy or s.event.query():
                self._next = (self._next + i + 1) % n
                break
        else:
            if n < self.max_depth:
                s = _Slot(self._alloc(self._size(nbytes)), self._make_event())
                self._slots.insert(self._next, s)
                self._next = (self._next + 1) % len(self._slots)
                return s
            s = self._slots[self._next]
            s.event.synchronize()  # max_depth copies in flight: the host must wait
            self._next = (self._next + 1) % n
        if s.buf.numel() < nbytes:
            # Safe to drop: its last copy has run (torch's host allocator also keeps a
            # pinned block alive until the copies recorded on it complete).
            s.grow(self._alloc(self._size(nbytes)))
        return s

    def _size(self, nbytes: int) -> int:
        return max(self.min_bytes, 1 << max(0, int(nbytes) - 1).bit_length())

    def _current_stream(self) -> Any:
        """``torch.cuda.current_stream(self.device)``, the kept object while its handle is current."""
        raw = current_raw_stream(self.device)
        if raw != self._raw:
            self._stream, self._raw = torch.cuda.current_stream(self.device), raw
        return self._stream

    def to_device(self, host: np.ndarray) -> torch.Tensor:
        """A device copy of the contiguous array ``host`` (same dtype and shape), queued on
        the device's current stream; ``host`` may be reused as soon as this returns."""
        host = np.ascontiguousarray(host)
        with self._lock:
            s = self._free_slot(host.nbytes)
            staged = s.fill(host)
            if torch.is_inference_mode_enabled():
                # What the caller gets (an extend's out_cache_loc, a page table) is a normal tensor
                # under inference mode too, as a CPU pool's: an engine may write into it later,
                # outside inference mode, where an inference tensor refuses in-place updates.
                with torch._C._InferenceMode(False):
                    dev = staged.to(self.device, non_blocking=True)
            else:
                dev = staged.to(self.device, non_blocking=True)
            if self.device.type == "cuda":
                s.event.record(self._current_stream())
            else:
                s.event.record()
            s.busy = True
        return dev
