"""Whole-page transfers between a pool's device caches and a page-major host copy.

``offload_pages`` (device -> host) and ``load_pages`` (host -> device) move
whole pages, every layer and every cache (K and V, or the MLA latent), for any
batch of (source, destination) page pairs.

Layouts. A device cache is ``[num_layers, num_slots, H, D]`` with slot =
page * P + offset, so one page of one layer is a contiguous chunk of
``P * H * D`` elements and one page across layers is ``num_layers`` such
chunks, ``num_slots * H * D`` elements apart. The host copy is
``[host_pages, C, num_layers, P, H, D]`` (C = number of caches): one
contiguous block per host page holding every layer's K and V, so a page
moves as one block however many layers the model has.

Bytes, not values: both directions move raw bytes (as the widest integer words
that divide a chunk), so every dtype, fp8 included, round-trips bitwise.

Backends (``method``):
  ``"kernel"`` (default): one Triton launch per call on CUDA, reading or
      writing the pinned host buffer through its device-mapped (UVA) address;
      through the Triton interpreter on CPU under TRITON_INTERPRET=1, and
      torch index ops on CPU otherwise.
  ``"copy"``: a device-side gather/scatter into a contiguous staging buffer
      plus one ``cudaMemcpyAsync`` (torch ``copy_``) per run of consecutive
      host pages. Same result; which one is faster is measured by
      benchmarks/gpu_check.py's ``host_tier`` section.

Page ids are host integers (numpy arrays, lists or CPU tensors): the core
hands them out on the host, and checking them there costs no device sync.
Page 0 of either side is reserved (the null page) and refused, as is a page
id out of range or a destination named twice. Everything is checked before
anything is queued or written. On CUDA the work is queued on the current
stream and nothing waits for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvpool._values import host_array
from kvpool.errors import (
    DuplicateSlotError,
    KernelArgumentError,
    LayerIndexError,
    ReservedSlotError,
    SlotRangeError,
    TensorDeviceError,
    TensorDtypeError,
    TensorShapeError,
)
from kvpool.kernels import _common as c
from kvpool.kernels._guard import capturing, on_device
from kvpool.torch_types import INT_DTYPES

__all__ = ["METHODS", "PageTransfer", "load_pages", "offload_pages"]

METHODS = ("kernel", "copy")

#: Host int64 ids -> the same ids as a tensor on the device (a pool's pinned ring).
Stage = Callable[[np.ndarray], torch.Tensor]


def _word(nbytes: int) -> torch.dtype:
    """The widest integer dtype whose size divides ``nbytes`` (CPU index ops move
    8-byte words far faster than single bytes; the kernel's accesses widen too)."""
    for dt in (torch.int64, torch.int32, torch.int16):
        if nbytes % dt.itemsize == 0:
            return dt
    return torch.uint8


def _host_tensor(host: Any) -> torch.Tensor:
    t = getattr(host, "buffer", host)  # a HostStorage, or its buffer
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(
            f"host must be a HostStorage or a [host_pages, C, L, P, H, D] tensor, got {type(host).__name__}"
        )
    return t


def _caches(device_caches: Any) -> list[torch.Tensor]:
    if not isinstance(device_caches, (list, tuple)) or len(device_caches) not in (1, 2):
        raise KernelArgumentError(
            "device_caches must be a list of one (MLA latent) or two (K, V) "
            "[num_layers, num_slots, H, D] tensors"
        )
    out = list(device_caches)
    first = out[0]
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise KernelArgumentError(f"device_caches[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in c.CACHE_DTYPES:
            raise TensorDtypeError(f"device_caches[{i}] has dtype {t.dtype}; expected one of {list(c.CACHE_DTYPES)}")
        if t.dim() != 4 or not t.is_contiguous():
            raise TensorShapeError(
                f"device_caches[{i}] must be a contiguous [num_layers, num_slots, H, D] tensor "
                f"(a KVStorage cache), got shape {tuple(t.shape)}"
                + ("" if t.is_contiguous() else " (not contiguous)")
            )
        if (t.shape, t.dtype, t.device) != (first.shape, first.dtype, first.device):
            raise TensorShapeError(
                f"device_caches[{i}] is {tuple(t.shape)} {t.dtype} on {t.device}, device_caches[0] "
                f"is {tuple(first.shape)} {first.dtype} on {first.device}: the caches of one pool match"
            )
    return out


def _ids(x: Any, name: str) -> np.ndarray:
    """Page ids as a host int64 array (no bools, floats or device tensors)."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise TensorDeviceError(
                f"{name} is on {x.device}: page ids must be host integers (numpy, list or a CPU "
                "tensor), as the core hands them out, so they are checked without a device sync"
            )
        c.check_dense(x, name)
        if x.dtype not in INT_DTYPES:  # (.numpy() refused bf16, quantized, bits and grad tensors untyped)
            raise TensorDtypeError(f"{name} must be a 1-D array of integer page ids, got a {x.dtype} tensor")
        x = x.numpy()
    arr = host_array(name, x)
    kinds = set(map(type, x)) if arr.dtype.kind in "iu" and isinstance(x, (list, tuple)) else set()
    if {bool, np.bool_} & kinds or {torch.Tensor, np.ndarray} & kinds and any(  # (0-d bool tensors too)
            getattr(v, "dtype", None) in (torch.bool, np.bool_) for v in x):
        raise TensorDtypeError(f"{name} holds a bool: pass int page ids (numpy takes True as page 1)")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise TensorDtypeError(f"{name} must be a 1-D array of integer page ids, got dtype {arr.dtype}, "
                               f"shape {arr.shape}")
    if arr.dtype.kind == "u" and int(arr.max()) > np.iinfo(np.int64).max:
        raise SlotRangeError(f"{name} has page id {int(arr.max())}, past int64")
    return arr.astype(np.int64, copy=False)


def check_host_geometry(caches: list[torch.Tensor], h: torch.Tensor, page_size: int | None = None) -> None:
    """Host pages ``h`` ([host_pages, C, L, P, H, D]) of the device caches' geometry and dtype,
    and of ``page_size`` where the caller knows it: the caches carry none, so storage built
    for another page size would pass the rest and move the wrong slots."""
    layers_n, _, heads, dim = caches[0].shape
    if h.dim() != 6:
        raise TensorShapeError(f"host must be [host_pages, C, L, P, H, D], got shape {tuple(h.shape)}")
    _, nc, hl, page, hh, hd = h.shape
    if (nc, hl, hh, hd) != (len(caches), layers_n, heads, dim) or page_size not in (None, page):
        pool_page = "" if page_size is None else f", P={page_size}"
        raise TensorShapeError(
            f"host pages are [C={nc}, L={hl}, P={page}, H={hh}, D={hd}], the device caches are "
            f"C={len(caches)}, L={layers_n}{pool_page}, H={heads}, D={dim}: build the host storage for this pool"
            + ("" if page_size is None else " (HostStorage.for_pool(pool, ...))"))
    if h.dtype != caches[0].dtype:
        raise TensorDtypeError(f"host has dtype {h.dtype}, the device caches {caches[0].dtype}: bytes move as "
                               "they are, so both must match: build the host storage for this pool")


def _check_range(ids: np.ndarray, name: str, num_pages: int, side: str) -> None:
    if ids.size == 0:
        return
    bad = np.flatnonzero((ids < 1) | (ids >= num_pages))
    if bad.size:
        i = int(bad[0])
        v = int(ids[i])
        if v == 0:
            raise ReservedSlotError(
                f"{name}[{i}] is page 0, the reserved null page of the {side}; valid pages are [1, {num_pages})"
            )
        raise SlotRangeError(f"{name}[{i}] = {v} is out of range: the {side} has pages [1, {num_pages})")


def _check_distinct(ids: np.ndarray, name: str) -> None:
    if ids.size < 2:
        return
    s = np.sort(ids)
    dup = np.flatnonzero(s[1:] == s[:-1])
    if dup.size:
        raise DuplicateSlotError(
            f"{name} names page {int(s[dup[0]])} twice: each destination page may be written by one "
            "pair only (which source would land is unspecified)"
        )


def _layers(layers: Any, num_layers: int) -> tuple[int, int]:
    """(first layer, count) of ``layers``: None (all), an int, or a range/slice with step 1."""
    if layers is None:
        return 0, num_layers
    if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):
        if not 0 <= int(layers) < num_layers:
            raise LayerIndexError(f"layer {layers} is out of range: the caches have layers [0, {num_layers})")
        return int(layers), 1
    if isinstance(layers, slice):
        layers = range(*layers.indices(num_layers))
    if isinstance(layers, range) and layers.step == 1 and len(layers) > 0:
        if layers.start < 0 or layers.stop > num_layers:
            raise LayerIndexError(f"layers {layers} are out of range: the caches have layers [0, {num_layers})")
        return layers.start, len(layers)
    raise LayerIndexError(f"layers must be None, an int or a non-empty range with step 1, got {layers!r}")


class PageTransfer:
    """One validated batch of page moves, ready to run (all layers at once or a layer
    range at a time, e.g. one launch per layer for layer-pipelined prefill).

    Build it with ``PageTransfer.offload`` / ``PageTransfer.load``; every argument
    check happens there and nothing is queued, so a caller can validate several
    transfers before running any. On CUDA the page ids go to the device once, at
    the first ``run``, on the stream current then (``stage`` overrides how).
    """

    def __init__(self, device_caches: Any, host: Any, src: Any, dst: Any, *, to_host: bool, method: str,
                 stage: Stage | None) -> None:
        if method not in METHODS:
            raise KernelArgumentError(f"method must be one of {METHODS}, got {method!r}")
        caches = _caches(device_caches)
        h = _host_tensor(host)
        check_host_geometry(caches, h)
        layers_n, num_slots, heads, dim = caches[0].shape
        host_pages, page = h.shape[0], h.shape[3]
        if page < 1 or num_slots % page:
            raise TensorShapeError(f"the device caches' {num_slots} slots are not whole pages of {page}")
        if h.device.type != "cpu" or not h.is_contiguous():
            raise TensorDeviceError(f"host must be a contiguous CPU tensor, got one on {h.device}"
                                    + ("" if h.is_contiguous() else " (not contiguous)"))
        dev = caches[0].device
        if dev.type == "cuda" and not h.is_pinned():
            raise TensorDeviceError(
                "host is pageable memory: transfers with a CUDA pool need pinned host memory "
                "(HostStorage pins it), or the copies could not be asynchronous"
            )
        # As store_kv and copy_slots: the moves write raw words, so nothing else would refuse
        # a destination torch forbids changing in this mode.
        for i, t in enumerate([h] if to_host else caches):
            c.check_writable(t, "host" if to_host else f"device_caches[{i}]")
        num_pages = num_slots // page
        src_ids, dst_ids = _ids(src, "device_pages" if to_host else "host_pages"), _ids(
            dst, "host_pages" if to_host else "device_pages")
        if src_ids.shape != dst_ids.shape:
            raise TensorShapeError(f"{src_ids.size} source pages but {dst_ids.size} destination pages")
        dev_ids, host_ids = (src_ids, dst_ids) if to_host else (dst_ids, src_ids)
        _check_range(dev_ids, "device_pages", num_pages, "device")
        _check_range(host_ids, "host_pages", host_pages, "host storage")
        _check_distinct(dst_ids, "host_pages" if to_host else "device_pages")

        self.to_host, self.method, self.device = to_host, method, dev
        self.num_layers, self.n = layers_n, int(src_ids.size)
        self.dev_ids, self.host_ids = dev_ids, host_ids
        chunk_bytes = page * heads * dim * h.element_size()
        self.page_bytes = chunk_bytes * layers_n * len(caches)
        word = _word(chunk_bytes)
        self.chunk = chunk_bytes // word.itemsize
        # Raw words: every dtype (fp8 included) moves bitwise, and CPU index ops run on ints.
        self.dev_words = [t.view(layers_n, -1).view(torch.uint8).view(word).view(layers_n, num_pages, self.chunk)
                          for t in caches]
        self.host_words = h.view(host_pages, -1).view(torch.uint8).view(word).view(
            host_pages, len(caches), layers_n, self.chunk)
        self._stage = stage
        self._triton = method == "kernel" and c.use_triton(caches[0])
        self._ids_dev: torch.Tensor | None = None  # [2, n]: device ids, host ids (Triton)
        self._runs: list[tuple[int, int, int]] = []
        self._dev_sorted: torch.Tensor | None = None  # device ids in host-page order (copy)
        self._staged_once = False
        if method == "copy" and self.n:
            # Sorted by host page, so that consecutive host pages form one copy.
            self._order = np.argsort(host_ids, kind="stable")
            self._host_sorted = host_ids[self._order]
            self._runs = _runs(self._host_sorted)

    @classmethod
    def offload(cls, device_caches: Any, host: Any, device_pages: Any, host_pages: Any, *, method: str = "kernel",
                stage: Stage | None = None) -> PageTransfer:
        """Device pages ``device_pages[i]`` -> host pages ``host_pages[i]`` (validated, not run)."""
        return cls(device_caches, host, device_pages, host_pages, to_host=True, method=method, stage=stage)

    @classmethod
    def load(cls, host: Any, device_caches: Any, host_pages: Any, device_pages: Any, *, method: str = "kernel",
             stage: Stage | None = None) -> PageTransfer:
        """Host pages ``host_pages[i]`` -> device pages ``device_pages[i]`` (validated, not run)."""
        return cls(device_caches, host, host_pages, device_pages, to_host=False, method=method, stage=stage)

    @property
    def nbytes(self) -> int:
        """Bytes this transfer moves over all layers."""
        return self.n * self.page_bytes

    def _ensure_staged(self) -> None:
        """Put the page ids on the device, once, on the stream current at the first run
        (so a transfer built on one stream and run on a copy stream stages there)."""
        if self._staged_once:
            return
        refuse_staging_in_capture(self.device, "offload_pages / load_pages (PageTransfer.run)")
        self._staged_once = True
        if self._triton:
            self._ids_dev = self._staged(np.stack([self.dev_ids, self.host_ids]))
        elif self.method == "copy":
            self._dev_sorted = self._staged(self.dev_ids[self._order])

    def _staged(self, ids: np.ndarray) -> torch.Tensor:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if self.device.type == "cpu":
            return torch.from_numpy(ids)
        if self._stage is not None:
            return self._stage(ids)
        # Pinned source: a true async copy, and torch's host allocator keeps the
        # buffer until the copy has run.
        return torch.from_numpy(ids).pin_memory().to(self.device, non_blocking=True)

    def run(self, layers: Any = None) -> None:
        """Queue (CUDA) or do (CPU) the moves for ``layers`` (None: all; an int; a range)."""
        l0, nl = _layers(layers, self.num_layers)
        if self.n == 0:
            return
        self._ensure_staged()
        if self._triton:
            from kvpool.kernels.page_copy import launch_page_copy

            assert self._ids_dev is not None
            with on_device(self.device):
                launch_page_copy(self.dev_words, self.host_words, self._ids_dev, self.to_host, l0, nl)
        elif self.method == "copy":
            self._run_copy(l0, nl)
        else:
            self._run_ref(l0, nl)

    def _run_ref(self, l0: int, nl: int) -> None:
        d = torch.from_numpy(self.dev_ids)
        h = torch.from_numpy(self.host_ids)
        for ci, cw in enumerate(self.dev_words):
            if self.to_host:
                self.host_words[h, ci, l0 : l0 + nl] = cw[l0 : l0 + nl, d].transpose(0, 1)
            else:
                cw[l0 : l0 + nl, d] = self.host_words[h, ci, l0 : l0 + nl].transpose(0, 1)

    def _run_copy(self, l0: int, nl: int) -> None:
        """Gather (or scatter) on the device through a contiguous staging buffer, and one
        ``copy_`` per run of consecutive host pages (one per page and cache when only some
        layers move: a layer range of a host page is contiguous, of several pages not)."""
        assert self._dev_sorted is not None
        nc = len(self.dev_words)
        staging = torch.empty((self.n, nc, nl, self.chunk), dtype=self.dev_words[0].dtype, device=self.device)
        whole = nl == self.num_layers
        runs = self._runs if whole else [(i, int(h), 1) for i, h in enumerate(self._host_sorted)]
        if self.to_host:
            for ci, cw in enumerate(self.dev_words):
                staging[:, ci] = cw[l0 : l0 + nl].index_select(1, self._dev_sorted).transpose(0, 1)
        for i, h0, length in runs:
            if whole:
                _move(self.host_words[h0 : h0 + length], staging[i : i + length], self.to_host)
                continue
            for ci in range(nc):
                _move(self.host_words[h0, ci, l0 : l0 + nl], staging[i, ci], self.to_host)
        if not self.to_host:
            for ci, cw in enumerate(self.dev_words):
                cw[l0 : l0 + nl].index_copy_(1, self._dev_sorted, staging[:, ci].transpose(0, 1))


def refuse_staging_in_capture(device: torch.device, what: str) -> None:
    """Raise ``TensorDeviceError`` if ``device``'s current stream is capturing a CUDA graph:
    a transfer's first run copies its host page ids to the device, from a pinned buffer that
    is freed (or a ring slot refilled) once the copy has run, so a replay would read stale or
    freed memory, and a ring's event recorded inside the capture poisons every later query."""
    if capturing(device):
        raise TensorDeviceError(
            f"{what} was called while a CUDA graph is being captured on {device}: a transfer "
            "copies its host page ids to the device, which cannot be captured. Run transfers "
            "between steps (before capture or between replays). Nothing was queued"
        )


def _move(host: torch.Tensor, dev: torch.Tensor, to_host: bool) -> None:
    """One ``cudaMemcpyAsync`` between a contiguous host block and a contiguous device block."""
    if to_host:
        host.copy_(dev, non_blocking=True)
    else:
        dev.copy_(host, non_blocking=True)


def _runs(sorted_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """(index, first id, length) of each run of consecutive ids in a sorted array."""
    if sorted_ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(sorted_ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [sorted_ids.size])))
    return [(int(s), int(sorted_ids[s]), int(n)) for s, n in zip(starts, lengths)]


def offload_pages(device_caches: Sequence[torch.Tensor], host_storage: Any, device_pages: Any, host_pages: Any,
                  *, layers: Any = None, method: str = "kernel", stage: Stage | None = None) -> None:
    """Copy device pages ``device_pages[i]`` into host pages ``host_pages[i]``: every layer
    of every cache, one launch (``method="kernel"`` on CUDA).

    Args:
        device_caches: the pool's caches, ``[K, V]`` or ``[latent]``, each a contiguous
            ``[num_layers, num_slots, H, D]`` tensor (``KVStorage.caches``).
        host_storage: a ``kvpool.tiers.HostStorage`` or its ``[host_pages, C, L, P, H, D]``
            buffer (pinned when the caches are on CUDA).
        device_pages, host_pages: host int arrays of equal length; ids in ``[1, pages)``
            (page 0 is reserved on both sides); no host page twice.
        layers: None (all), an int or a range of layers to move.
        method: ``"kernel"`` or ``"copy"`` (see the module doc).
        stage: how to put the page ids on the device (a pool's pinned ring); default
            a pinned copy.

    Raises:
        KernelArgumentError, TensorShapeError, TensorDtypeError, TensorDeviceError: the
            caches and the host storage do not match.
        SlotRangeError, ReservedSlotError, DuplicateSlotError: a bad page id.
        LayerIndexError: a bad ``layers``.
        Nothing is written when any of these is raised.
    """
    t = PageTransfer.offload(device_caches, host_storage, device_pages, host_pages, method=method, stage=stage)
    t.run(layers)


def load_pages(host_storage: Any, device_caches: Sequence[torch.Tensor], host_pages: Any, device_pages: Any,
               *, layers: Any = None, method: str = "kernel", stage: Stage | None = None) -> None:
    """Copy host pages ``host_pages[i]`` into device pages ``device_pages[i]``: every layer of
    every cache, one launch (``method="kernel"`` on CUDA). Arguments and errors as
    ``offload_pages`` (no device page twice)."""
    t = PageTransfer.load(host_storage, device_caches, host_pages, device_pages, method=method, stage=stage)
    t.run(layers)
