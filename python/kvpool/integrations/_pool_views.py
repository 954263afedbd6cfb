"""What ``KVPoolCache``'s page bookkeeping (``_pages.StepPages``) derives from a pool once, and
the checks it makes on slots and page tables: whether they form one strided run that a
single view of a cache covers."""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvpool._forksafe import INNER
from kvpool._forksafe import track as track_for_fork
from kvpool.integrations._layer_buffers import BufferSpares
from kvpool.modes import persistent, register_kept_for_pool
from kvpool.staging import to_device
from kvpool.validate import check_pool


class PoolViews:
    """What never changes for a pool: its caches' token-major and paged views, and how its
    layers' K and V sit in the one allocation. Made once per pool (``pool_views``)."""

    def __init__(self, pool: Any) -> None:
        self.page = int(pool.page_size)
        self.h, self.d = int(pool.num_kv_heads), int(pool.head_dim)
        self.row = self.page * self.h * self.d  # elements of one page of one layer
        # Each layer's caches, token-major [num_slots, H, D] and by page [num_pages, page * H * D].
        self.flat = [(k.reshape(-1, self.h, self.d), v.reshape(-1, self.h, self.d))
                     for k, v in zip(pool.k_buffers, pool.v_buffers)]
        self.paged = [(k.view(-1, self.row), v.view(-1, self.row)) for k, v in self.flat]
        layers, num_pages = len(self.flat), self.paged[0][0].shape[0]
        # KVPool keeps every layer's K, then every layer's V, back to back in one allocation.
        # Then one strided view covers every layer's K and V (views and store views), and
        # every page of every cache is a row of one [2 * layers * num_pages, page * H * D]
        # view (the gather path: one index_select per layer for K and V together).
        self.layer_step = even_spacing([k for k, _ in self.flat] + [v for _, v in self.flat])
        k0 = self.flat[0][0]
        self.all_pages: torch.Tensor | None = None
        self.page_offsets: np.ndarray | None = None
        if self.layer_step == num_pages * self.row:
            self.all_pages = k0.as_strided((2 * layers * num_pages, self.row), (self.row, 1), k0.storage_offset())
            # Row of page p of layer l's K (l * num_pages + p) and V ((layers + l) * num_pages + p).
            self.page_offsets = ((np.arange(layers)[:, None] + np.array([0, layers])) * num_pages)[..., None]
        self.to_device = getattr(pool, "_to_device", None)
        self.cpu = torch.device(pool.device).type == "cpu"
        # Every cache's slots as one [2 * layers, num_slots, H, 1, D] view (K of each layer, then
        # V; the 1 is a decode step's token): one index_copy_ stores a decode step's token of
        # every layer (``StepPages``).
        self.all_slots: torch.Tensor | None = None
        if self.layer_step is not None and all(c.stride() == (self.h * self.d, self.d, 1)
                                               for pair in self.flat for c in pair):
            with persistent():  # stored into under any grad mode
                self.all_slots = k0.as_strided((2 * layers, k0.shape[0], self.h, 1, self.d),
                                               (self.layer_step, self.h * self.d, self.d, self.d, 1),
                                               k0.storage_offset())
        # On a CPU pool, the same memory as one [rows, H, D] view, cache c's slot s at row
        # ``cache_rows[c] + s``: a flush's store of every layer's tokens is then one call of the
        # core's row copy (``scatter_into``), where ``index_copy_`` walks each row element by
        # element (most of the host time of a batch's flush whose rows' pages are not in order).
        self.all_rows: torch.Tensor | None = None
        self.cache_rows: np.ndarray | None = None
        hd = self.h * self.d
        if self.all_slots is not None and self.cpu and self.layer_step % hd == 0:
            step = self.layer_step // hd
            with persistent():
                self.all_rows = k0.as_strided(((2 * layers - 1) * step + k0.shape[0], self.h, self.d),
                                              (hd, self.d, 1), k0.storage_offset())
            self.cache_rows = (np.arange(2 * layers, dtype=np.int64) * step)[:, None]
        # Staging buffers (flat) of closed caches, each with its ``stream_mark`` and the streams
        # it is marked as used on, for the pool's next caches (append and pop are atomic, so
        # caches in several threads never take the same one).
        self.spare_stages: list[tuple[torch.Tensor, Any, set[Any]]] = []
        # Layer buffers of closed caches, with the views they made (``_layer_buffers``).
        self.spare_buffers = BufferSpares()


# Keyed by the pool, which the entries do not reference (their views hold its memory alive,
# not the pool object), so an entry goes with its pool.
_POOL_VIEWS: weakref.WeakKeyDictionary[Any, PoolViews] = weakref.WeakKeyDictionary()


def _kept(pool: Any) -> list[tuple[str, torch.Tensor]]:
    """audit(pool)'s view of what closed caches left to ``pool``'s next caches."""
    views = _POOL_VIEWS.get(pool)
    if views is None:
        return []
    out = [(f"cache_spares.stage[{i}]", t) for i, (t, *_) in enumerate(list(views.spare_stages))]
    sets = list(views.spare_buffers._sets.values())
    return out + [(f"cache_spares.layer_buffers[{i}]", lb.buf) for i, lb in enumerate(sets)]


register_kept_for_pool(_kept)

# Caches made on several threads at once must get one PoolViews: the spares are in it, and
# another one's would serve only the caches that took it, out of release_buffers' reach.
_MAKING = threading.Lock()
# Held across a fork (the module lives as long as the process): a forked child's first cache
# would otherwise wait on it forever.
track_for_fork(sys.modules[__name__], "_MAKING", INNER)


def pool_views(pool: Any) -> PoolViews:
    """The pool's ``PoolViews``, made at its first cache."""
    try:
        return _POOL_VIEWS[pool]
    except (KeyError, TypeError):  # TypeError: a pool that takes no weak reference
        pass
    with _MAKING:
        try:
            return _POOL_VIEWS[pool]
        except (KeyError, TypeError):
            views = PoolViews(pool)
        try:
            _POOL_VIEWS[pool] = views
        except TypeError:
            pass
        return views


def release_buffers(pool: Any) -> int:
    """Free the layer buffers that closed ``KVPoolCache``s left to ``pool``'s next caches (a
    copy of a small batch's K/V each, kept so that the next cache of the same batch size
    reuses them and the views into them; at most four sets of 64 MiB), and the staging
    buffers of closed ``layer_buffers=False`` caches (one layer's K/V of a batch each, at
    most two). Returns the bytes freed. Open caches keep theirs.

    Raises:
        InvalidArgumentError: ``pool`` is not a ``KVPool``.
    """
    check_pool(pool, "release_buffers")
    # Only a pool that had a cache has spares; a hybrid pool's caches keep none (and have no
    # PoolViews, which would need the plain pool's page_size).
    try:
        views = _POOL_VIEWS.get(pool)
    except TypeError:  # a pool that takes no weak reference: its caches kept no spares here
        views = None
    if views is None:
        return 0
    spares = views.spare_buffers
    freed = spares.nbytes
    spares.clear()
    stages = views.spare_stages
    while True:
        try:  # (pop: atomic, as a cache on another thread may take one meanwhile)
            stage, *_ = stages.pop()
        except IndexError:
            return freed
        freed += stage.numel() * stage.element_size()


def index_tensor(host: np.ndarray, upload: Callable[[np.ndarray], torch.Tensor] | None = None,
                 device: torch.device | None = None) -> torch.Tensor:
    """``host`` as an index tensor that is a normal tensor under any grad mode: made under
    inference mode it would be an inference tensor, which autograd refuses to save, and a
    cache opened under ``inference_mode`` may run its next steps outside it. Uploaded by
    ``upload`` (a pool's pinned ring) when given; with ``device``, on it (``staging.to_device``:
    without a ring, a non-blocking copy from pageable memory)."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return _index_tensor(host, upload, device)
    return _index_tensor(host, upload, device)


def _index_tensor(host: np.ndarray, upload: Callable[[np.ndarray], torch.Tensor] | None,
                  device: torch.device | None) -> torch.Tensor:
    if device is not None:
        return to_device(host, device, upload)
    return upload(host) if upload is not None else torch.from_numpy(host)


def decode_run(s: list[int]) -> tuple[int, int] | None:
    """``slot_run`` of one slot per row, given as a list."""
    if len(s) == 1:
        return s[0], 0
    apart = s[1] - s[0]
    if apart < 1 or any(y - x != apart for x, y in zip(s[1:], s[2:])):
        return None
    return s[0], apart


def slot_run(slots: np.ndarray, b: int, t: int) -> tuple[int, int] | None:
    """(first slot, slots from one row's first to the next) when each row's ``t`` new slots
    (``slots`` row-major) are consecutive and the rows are equally far apart, without
    overlapping, so one strided view of a cache covers them; None otherwise."""
    if t == 1 and b <= 16:  # a decode step: a handful of ints, cheaper as a list than in numpy
        return decode_run(slots.tolist())
    run = strided_run(slots.reshape(b, t))
    if run is None or (b > 1 and run[1] < t):
        return None
    return run


def strided_run(table: np.ndarray) -> tuple[int, int] | None:
    """(first page, pages from one row's first page to the next) when every row's pages
    are consecutive and the rows are equally far apart, so one strided view covers
    them; None otherwise."""
    b, n = table.shape
    if n == 0:
        return None
    if b * n <= 256:  # as lists: cheaper than numpy's first calls after the model's forward
        rows = table.tolist()
        if n > 1 and any(row != list(range(row[0], row[0] + n)) for row in rows):
            return None
        if b == 1:
            return rows[0][0], 0
        apart = rows[1][0] - rows[0][0]
        if apart < 0 or any(y[0] - x[0] != apart for x, y in zip(rows[1:], rows[2:])):
            return None
        return rows[0][0], apart
    if n > 1 and not bool((table[:, 1:] - table[:, :-1] == 1).all()):
        return None
    if b == 1:
        return int(table[0, 0]), 0
    apart = table[1:, 0] - table[:-1, 0]
    if not bool((apart == apart[0]).all()) or int(apart[0]) < 0:
        return None
    return int(table[0, 0]), int(apart[0])


def even_spacing(tensors: list[torch.Tensor]) -> int | None:
    """The element offset from each tensor to the next, if they share one storage and are
    evenly spaced in it (0 for a single tensor); None otherwise."""
    if len(tensors) == 1:
        return 0
    base = tensors[0].untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != base for t in tensors):
        return None
    offsets = [t.storage_offset() for t in tensors]
    step = offsets[1] - offsets[0]
    if step <= 0 or any(b - a != step for a, b in zip(offsets, offsets[1:])):
        return None
    return int(step)
