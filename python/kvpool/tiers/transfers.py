"""Runs one call's queued K/V work in the documented order, off the compute stream.

The core queues three kinds of work and never moves bytes itself: offloads
(device page -> host page), loads (host page -> device page) and
copy-on-write copies (device slot -> device slot). Before a step's K/V writes
they must run in that order: offloads, then loads, then copies. An offload's
source device page may be handed out again by the same call as a load's
destination or a new holder's page, and a load's destination page may be the
source of a copy, so each kind must have finished reading before the next
writes.

On CUDA ``TransferRunner.run`` queues them on a dedicated copy stream, so
they overlap the compute stream's other work, and orders them with events,
never with a host sync:

1. the copy stream waits for the caller's current stream, so pages the steps
   before wrote are complete before an offload reads them;
2. offloads, loads, copies, in that order, on the copy stream;
3. the caller's current stream waits for an event recorded after them, so
   every kernel the engine queues afterwards (the step's writes and reads)
   runs after the transfers.

Layer-pipelined prefill (``layered=True``): the caller's stream waits only for
the offloads (so fresh pages can be written at once); loads and copies run one
layer at a time, each layer followed by its own event, and the engine calls
``TransferBatch.wait_layer(i)`` before layer i's first kernel that touches the
KV cache, so layer 0's attention starts while later layers are still loading.

Lifetimes: index tensors are staged while the copy stream is current, so
torch's caching allocator ties them to that stream; the device caches are
marked as used by the copy stream once (``record_stream``), so freeing a pool
with transfers in flight cannot hand their memory out early; pinned id
buffers are kept by torch's host allocator (or the pool's pinned ring) until
their copy has run.

On CPU everything runs synchronously, in the same order, before ``run``
returns. Stream and event factories are injectable (``streams=``), so the
ordering is tested on CPU with fakes.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvpool._values import host_array
from kvpool.errors import DuplicateSlotError, KernelArgumentError, SlotRangeError, TensorShapeError
from kvpool.kernels import copy_slots
from kvpool.kernels.pages import PageTransfer, Stage, _host_tensor, check_host_geometry, refuse_staging_in_capture
from kvpool.streams import current_raw_stream
from kvpool.torch_types import as_device
from kvpool.validate import check_layer, require_plain_pool

__all__ = ["CudaStreams", "TransferBatch", "TransferRunner"]

Pairs = tuple[Any, Any] | None


class CudaStreams:
    """The stream operations a ``TransferRunner`` needs, on one CUDA device (tests pass
    an object with the same four methods that records calls instead)."""

    def __init__(self, device: torch.device, priority: int = 0) -> None:
        self.device, self.priority = device, priority

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device, priority=self.priority)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def use(self, stream: Any) -> AbstractContextManager:
        return torch.cuda.stream(stream)

    def key(self, stream: Any = None) -> int:
        """What tells ``stream`` (default: the current one) apart: its raw handle, read without
        making a Stream object (``current()`` makes one at every call, ~4 µs of host time)."""
        return current_raw_stream(self.device) if stream is None else int(stream.cuda_stream)


@dataclass
class TransferBatch:
    """What one ``TransferRunner.run`` queued, and how to wait for it.

    ``event`` is recorded on the copy stream after all of the batch's work;
    ``layer_events[i]`` (layered runs) after layer i's loads and copies. Both
    are None when the work already ran (CPU) or nothing was queued.
    Unless the run was layered, the caller's stream already waits for ``event``.
    """

    offloaded_pages: int = 0
    loaded_pages: int = 0
    copied_slots: int = 0
    offloaded_bytes: int = 0
    loaded_bytes: int = 0
    event: Any = None
    layer_events: list[Any] | None = None
    _streams: Any = field(default=None, repr=False)
    _num_layers: int | None = field(default=None, repr=False)  # set by the runner: what wait_layer checks

    def _stream(self, stream: Any) -> Any:
        return stream if stream is not None else self._streams.current()

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current one) wait for the whole batch; no host sync."""
        if self.event is not None:
            self._stream(stream).wait_event(self.event)

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Make ``stream`` (default: the current one) wait for layer ``layer``'s loads and
        copies (layered runs; otherwise the whole batch); no host sync.

        Raises:
            LayerIndexError: ``layer`` is not an int in ``[0, num_layers)`` (nothing waits).
        """
        if self.layer_events is not None:
            layer = check_layer(layer, len(self.layer_events))
        elif self._num_layers is not None:
            check_layer(layer, self._num_layers)
        if self.layer_events is None:
            self.wait(stream)
            return
        self._stream(stream).wait_event(self.layer_events[layer])

    def synchronize(self) -> None:
        """Block the host until the whole batch has run (not on the scheduling path)."""
        if self.event is not None:
            self.event.synchronize()

    def done(self) -> bool:
        """Whether the whole batch has run (never blocks)."""
        return self.event is None or bool(self.event.query())


def _slots(x: Any, name: str) -> np.ndarray:
    arr = host_array(name, x.numpy() if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise KernelArgumentError(f"{name} must be a 1-D host array of integer slots, got {arr.dtype} {arr.shape}")
    return arr.astype(np.int64, copy=False)


def _sequence(v: Any) -> bool:
    """Whether ``v`` has at least one dimension. A ragged list (which numpy refuses) is
    one: its own check names it (``TensorShapeError``), before anything runs."""
    try:
        return bool(np.ndim(v) >= 1)
    except ValueError:
        return True


def _pair(name: str, value: Pairs) -> Pairs:
    """None, or the two id arrays a ``take_*()`` call returns (a tuple or list of two)."""
    if value is None or (isinstance(value, (tuple, list)) and len(value) == 2 and all(map(_sequence, value))):
        return value
    what = {"offloads": "(device_pages, host_pages), as take_offloads()",
            "loads": "(host_pages, device_pages), as take_loads()",
            "copies": "(src_slots, dst_slots), as take_copies()"}[name]
    raise KernelArgumentError(f"{name} must be None or the pair {what} returns, got {type(value).__name__}")


def _check_copies(src: np.ndarray, dst: np.ndarray, num_slots: int) -> None:
    """What copy_slots checks on host slots, done before any transfer of the batch runs."""
    if src.shape != dst.shape:
        raise TensorShapeError(f"copies: {src.size} source slots but {dst.size} destination slots")
    for name, a in (("src_slots", src), ("dst_slots", dst)):
        bad = np.flatnonzero((a < 0) | (a >= num_slots))
        if bad.size:
            raise SlotRangeError(f"copies: {name}[{int(bad[0])}] = {int(a[bad[0]])} is outside [0, {num_slots})")
    if np.unique(dst).size != dst.size or np.intersect1d(src, dst).size:
        raise DuplicateSlotError("copies: a destination slot repeats or is also a source; rows are copied in "
                                 "parallel, so the result would depend on scheduling")


def _caches(caches: Any) -> list[torch.Tensor]:
    """The runner's caches, checked when it is built: every later shape it reads comes from them."""
    if not isinstance(caches, (list, tuple)) or not caches or not all(isinstance(t, torch.Tensor) for t in caches):
        raise KernelArgumentError(f"caches must be a non-empty list of the pool's cache tensors ([K, V] or "
                                  f"[latent], as KVStorage.caches), got {type(caches).__name__} {caches!r:.60}")
    shapes = [tuple(t.shape) for t in caches]
    if any(len(s) != 4 or s[:2] != shapes[0][:2] for s in shapes):
        raise TensorShapeError(f"caches must each be [num_layers, num_slots, heads, head_dim], the same "
                               f"layers and slots, got shapes {shapes}")
    return list(caches)


class TransferRunner:
    """Runs offloads, loads and copy-on-write copies for one pool, in that order.

    Args:
        caches: the pool's caches (``KVStorage.caches``: ``[K, V]`` or ``[latent]``, each
            ``[num_layers, num_slots, H, D]``).
        host: the pool's ``HostStorage`` (None: copies only).
        device: the pool's device.
        method: how pages move (``kvpool.kernels.pages``: ``"kernel"`` or ``"copy"``).
        stage: host ids -> device tensor (the pool's pinned ring); default a pinned copy.
        streams: stream/event operations (default ``CudaStreams(device)`` on CUDA; None on CPU
            runs everything synchronously). Tests pass fakes.
    """

    def __init__(self, caches: Sequence[torch.Tensor], host: Any, device: Any, *, method: str = "kernel",
                 stage: Stage | None = None, streams: Any = None) -> None:
        self.caches = _caches(caches)
        self.host = host
        self.device = as_device(device)
        self.method, self._stage = method, stage
        if streams is None and self.device.type == "cuda":
            streams = CudaStreams(self.device)
        self._streams = streams
        self._copy_stream: Any = None
        self._last: Any = None  # event after the last batch's work
        self._waited: list[Any] = []  # streams already waiting for _last (their ``_key``)
        self.num_layers = self.caches[0].shape[0]
        self.num_slots = self.caches[0].shape[1]
        # Token-major per-layer views: what copy_slots takes (all layers, or one).
        self._layer_caches = [[c[i] for c in self.caches] for i in range(self.num_layers)]
        self._all_caches = [c for layer in self._layer_caches for c in layer]

    @classmethod
    def for_pool(cls, pool: Any, host: Any, **kw: Any) -> TransferRunner:
        """A runner for a ``KVPool`` (its caches, device and pinned ring) and its host storage.

        Raises:
            InvalidArgumentError: ``pool`` is not a plain ``KVPool``.
            TensorShapeError, TensorDtypeError: ``host`` was built for another geometry
                (page size, layers, heads, head_dim, MLA) or dtype than ``pool``'s.
        """
        require_plain_pool(pool, "TransferRunner.for_pool")
        if host is not None:  # (with the page size, which the caches cannot tell PageTransfer)
            check_host_geometry(pool._storage.caches, _host_tensor(host), pool.page_size)
        kw.setdefault("stage", getattr(pool, "_to_device", None))
        return cls(pool._storage.caches, host, pool.device, **kw)

    @property
    def copy_stream(self) -> Any:
        """The stream transfers run on (CUDA; made on first use)."""
        if self._copy_stream is None and self._streams is not None:
            self._copy_stream = self._streams.new_stream()
            if self.device.type == "cuda":
                for c in self.caches:  # freeing the pool must not reuse memory a transfer still touches
                    c.record_stream(self._copy_stream)
        return self._copy_stream

    def _plans(self, offloads: Pairs, loads: Pairs) -> tuple[PageTransfer | None, PageTransfer | None]:
        off = ld = None
        if offloads is not None and len(offloads[0]) + len(offloads[1]):
            off = PageTransfer.offload(self.caches, self._host(), offloads[0], offloads[1], method=self.method,
                                       stage=self._stage)
        if loads is not None and len(loads[0]) + len(loads[1]):
            ld = PageTransfer.load(self._host(), self.caches, loads[0], loads[1], method=self.method,
                                   stage=self._stage)
        return off, ld

    def _host(self) -> Any:
        if self.host is None:
            raise KernelArgumentError("this runner has no host storage: it runs copy-on-write copies only")
        return self.host

    def run(self, offloads: Pairs = None, loads: Pairs = None, copies: Pairs = None, *,
            layered: bool = False) -> TransferBatch:
        """Run (CPU) or queue (CUDA) one call's work: offloads, then loads, then copies.

        Args:
            offloads: ``(device_pages, host_pages)``, as ``take_offloads()`` returns them.
            loads: ``(host_pages, device_pages)``, as ``take_loads()`` returns them.
            copies: ``(src_slots, dst_slots)``, as ``take_copies()`` returns them.
            layered: per-layer events for layer-pipelined prefill (see the module doc).

        Returns:
            A ``TransferBatch`` (counts, and the events to wait on).

        Raises:
            Every argument error of ``offload_pages`` / ``load_pages`` / ``copy_slots``,
            checked for all three kinds before any of them runs (nothing moved).
            KernelArgumentError: a kind that is not a pair of arrays, or ``layered``
                not a bool.
        """
        offloads, loads = _pair("offloads", offloads), _pair("loads", loads)
        copies = _pair("copies", copies)
        if not isinstance(layered, (bool, np.bool_)):
            raise KernelArgumentError(f"layered takes True or False, got {type(layered).__name__} {layered!r}")
        off, ld = self._plans(offloads, loads)
        cp: tuple[np.ndarray, np.ndarray] | None = None
        if copies is not None:
            src, dst = _slots(copies[0], "src_slots"), _slots(copies[1], "dst_slots")
            _check_copies(src, dst, self.num_slots)
            if src.size:
                cp = (src, dst)
        batch = TransferBatch(
            offloaded_pages=off.n if off else 0, loaded_pages=ld.n if ld else 0,
            copied_slots=0 if cp is None else int(cp[0].size),
            offloaded_bytes=off.nbytes if off else 0, loaded_bytes=ld.nbytes if ld else 0,
            _streams=self._streams, _num_layers=self.num_layers,
        )
        if off is None and ld is None and cp is None:
            return batch  # nothing queued: no stream or event touched
        if self._streams is None:  # CPU: in order, now
            if off is not None:
                off.run()
            if ld is not None:
                ld.run()
            if cp is not None:
                copy_slots(self._all_caches, torch.from_numpy(cp[0]), torch.from_numpy(cp[1]))
            return batch
        # Before the copy stream joins the caller's: a capture would record the id copies.
        refuse_staging_in_capture(self.device, "TransferRunner.run")
        return self._queue(batch, off, ld, cp, layered)

    def _queue(self, batch: TransferBatch, off: PageTransfer | None, ld: PageTransfer | None,
               cp: tuple[np.ndarray, np.ndarray] | None, layered: bool) -> TransferBatch:
        s = self._streams
        caller, copy = s.current(), self.copy_stream
        copy.wait_stream(caller)
        with s.use(copy):
            if off is not None:
                off.run()
            cp_d = None if cp is None else self._staged_pair(*cp)
            if not layered:
                if ld is not None:
                    ld.run()
                if cp_d is not None:
                    copy_slots(self._all_caches, *cp_d)
            else:
                offloaded = s.new_event()
                offloaded.record(copy)
                caller.wait_event(offloaded)  # fresh pages may be written at once
                batch.layer_events = []
                for i in range(self.num_layers):
                    if ld is not None:
                        ld.run(i)
                    if cp_d is not None:
                        copy_slots(self._layer_caches[i], *cp_d)
                    ev = s.new_event()
                    ev.record(copy)
                    batch.layer_events.append(ev)
            done = s.new_event()
            done.record(copy)
        if not layered:
            caller.wait_event(done)
        batch.event = done
        # A layered run leaves the caller waiting for the offloads only: a later
        # wait() from it must still wait for the whole batch.
        self._last, self._waited = done, [] if layered else [self._key(caller)]
        return batch

    def _staged_pair(self, src: np.ndarray, dst: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        both = np.ascontiguousarray(np.stack([src, dst]))
        if self.device.type == "cpu":
            t = torch.from_numpy(both)
        elif self._stage is not None:
            t = self._stage(both)
        else:
            t = torch.from_numpy(both).pin_memory().to(self.device, non_blocking=True)
        return t[0], t[1]

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current one) wait for every transfer queued so far
        (what a later call on another stream does before it hands out pages); no host sync."""
        if self._last is None or self._streams is None:
            return
        # This runs at every extend once a transfer was queued: on CUDA the current stream is
        # told apart by its raw handle, and its Stream object made only when it must wait.
        key = self._key(stream)
        if key in self._waited:
            return
        (stream if stream is not None else self._streams.current()).wait_event(self._last)
        self._waited.append(key)

    def _key(self, stream: Any = None) -> Any:
        """What tells ``stream`` (None: the current one) apart: the streams' ``key`` where
        they have one (``CudaStreams``), else the stream object itself (fakes)."""
        key = getattr(self._streams, "key", None)
        if key is not None:
            return key(stream)
        return stream if stream is not None else self._streams.current()

    def synchronize(self) -> None:
        """Block the host until every queued transfer has run (shutdown, tests, the disk tier)."""
        if self._last is not None:
            self._last.synchronize()

