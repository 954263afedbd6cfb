"""``KVPool`` for hybrid models: layer groups with sliding windows and recurrent state.

``KVPool(..., layer_types=[...])`` builds this pool (``KVPool.__new__`` hands the
call here); without ``layer_types`` it is the plain pool, untouched. The core's
``GroupedAllocator`` owns pages and state slots; this layer owns every tensor:

- per attention group, each layer's K and V caches (``KVStorage``, the pool's
  layout) and a request-to-token table (``req_to_token[layer]``); a sliding
  group holds only the pages of each request's window, and the positions the
  window released read as the null page's slots;
- per state group, for each layer and each name of ``state_shapes``, a
  ``[num_slots, *shape]`` tensor (``state(layer, name)``); a request's row is
  ``state_slots(handles, layer)``.

Every request call acts on all groups at once (atomically, in the core) and
then runs the copies the core queued: copy-on-write of shared pages, and for
state groups the zeroing of a new request's slot, a fork's copy of its
parent's state, a checkpoint and a restore. Every tensor is created under
``persistent()``, as for the plain pool.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvpool._core import GroupedAllocator, InvalidArgumentError
from kvpool._eager import prepare as prepare_eager
from kvpool._forksafe import POOL
from kvpool._forksafe import track as track_for_fork
from kvpool._nopickle import NotPicklable
from kvpool.capacity import budget_bytes, fraction_of_memory, free_device_memory, pages_of_slots
from kvpool.hybrid_copies import HybridCopies
from kvpool.hybrid_ops import HybridExtendResult, HybridRequestOps
from kvpool.hybrid_plan import LayerGroup, check_slot_ids, plan_groups, plan_states, primary_pages_for_budget
from kvpool.hybrid_queries import HybridQueries
from kvpool.hybrid_rows import HybridRows
from kvpool.hybrid_tables import HybridTables
from kvpool.hybrid_views import HybridViews
from kvpool.kernels import require_triton
from kvpool.layout import LAYOUTS, KVStorage, padded_row_stride
from kvpool.modes import persistent
from kvpool.out_of_memory import refuse_out_of_memory
from kvpool.row_edits import RowEdits
from kvpool.staging import PinnedRing
from kvpool.streams import CopyOrder
from kvpool.torch_types import CACHE_DTYPES, FP8_DTYPES, as_device
from kvpool.validate import check_layer

__all__ = ["HybridExtendResult", "HybridKVPool"]


def _page_group(groups: list[LayerGroup], group_of_layer: Any, num_layers: int, layer: Any) -> LayerGroup:
    """The page group of ``layer`` (``HybridKVPool._page_group``)."""
    g = groups[group_of_layer[check_layer(layer, num_layers)]]
    if g.kind == "state":
        raise InvalidArgumentError(
            f"layer {layer} is a {g.layer_type} layer: it has state slots (state(layer, name), "
            "state_slots(handles, layer)), not K/V pages")
    return g


class _LayerTables(Sequence[torch.Tensor]):
    """``req_to_token[layer]``: the request-to-token table of the layer's group. It keeps the
    tables and the layer map, not the pool: a pool it named was in a reference cycle with it,
    and a dropped pool's memory (GPU memory, on a device) waited for the cyclic collector."""

    def __init__(self, pool: HybridKVPool) -> None:
        self._tables, self._groups = pool._tables, pool.groups
        self._group_of_layer, self._num_layers = pool.group_of_layer, pool.num_layers

    def __len__(self) -> int:
        return self._num_layers

    def __getitem__(self, layer: Any) -> Any:
        return self._tables[_page_group(self._groups, self._group_of_layer, self._num_layers, layer).index]

    def __iter__(self) -> Iterator[torch.Tensor]:
        # Sequence's own iteration stops at an IndexError, and a layer past the end raises
        # LayerIndexError (a ValueError): list(pool.req_to_token) raised at its end.
        return (self[layer] for layer in range(len(self)))


# The plain pool's options a hybrid pool lacks, each with the values that mean "not used".
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "kv_lora_rank": (None,), "qk_rope_head_dim": (None,), "tp_rank": (0,), "tp_size": (1,),
    "max_pinned_pages": (None, 0), "manual_clock": (False,), "lazy_metadata": (False,),
    "host_pages": (None, 0), "host_memory_bytes": (None,), "host_policy": (None, "write_back"),
}


def _unused(value: Any, defaults: tuple[Any, ...]) -> bool:
    # Same type and value: host_pages=False is no more "no tier" here than on a plain pool.
    # A numpy int is an int, as the plain pool takes it (host_pages=np.int64(0) is no tier).
    if isinstance(value, np.integer):
        value = int(value)
    return any(value is d or (type(value) is type(d) and value == d) for d in defaults)


class HybridKVPool(NotPicklable, HybridCopies, HybridRequestOps, HybridTables, HybridQueries, HybridViews, HybridRows,
                  RowEdits):
    """A ``KVPool`` over layer groups (see the module doc and docs/hybrid.md).

    Built as ``KVPool(num_layers, num_kv_heads, head_dim, layer_types=[...],
    sliding_window=W, state_shapes={...}, ...)``. Sizes: ``num_pages`` (or
    ``num_slots``) and ``page_size`` as for the plain pool size each full group
    (each sliding group when there is none); ``page_size`` may also be a dict
    by layer type; ``group_pages={layer_type: N}`` sets any group's pages (a
    state group's slots) explicitly; other groups get what their requests can
    need at once (``kvpool.hybrid_plan.plan_groups``); with ``memory_bytes`` /
    ``memory_fraction`` the full group (else the sliding one) gets what the
    others leave. MLA, fp8, tensor parallelism, retention priorities
    (``manual_clock`` too), ``lazy_metadata`` and the host tier are the plain
    pool's only (``InvalidArgumentError``, except at values that ask for none).

    Streams (CUDA), as the plain pool's: ``open`` (with state groups), ``extend``,
    ``admit``, ``fork``, ``open_with_prefix``, ``truncate`` and ``page_table`` raise
    ``TensorDeviceError`` while the caller's stream is capturing a CUDA graph, before
    anything changes; the copies the core queues run on the caller's stream, and a
    later call that hands out slots from another stream first waits for them.
    """

    _pickle_refusal = "it owns this process's K/V tensors and allocator state"
    allocator: GroupedAllocator  # (the mixins declare Any; type checkers take this one)

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        layer_types: Sequence[str],
        sliding_window: int | None = None,
        state_shapes: Mapping[str, Any] | None = None,
        group_pages: Mapping[str, int] | None = None,
        dtype: torch.dtype = torch.float16,
        device: Any = "cpu",
        page_size: Any = 1,
        num_pages: int | None = None,
        num_slots: int | None = None,
        memory_bytes: int | None = None,
        memory_fraction: float | None = None,
        max_requests: int = 256,
        max_context_len: int = 4096,
        layout: str = "token",
        compute_dtype: torch.dtype | None = None,
        hash_seed: int | None = None,
        handle_seed: int | None = None,
        kv_events: bool = True,
        **plain_only: Any,
    ) -> None:
        prepare_eager()  # (as KVPool: see kvpool._eager)
        for name, value in plain_only.items():
            if name not in _UNSUPPORTED:
                raise TypeError(f"KVPool() got an unexpected keyword argument {name!r}")
            if not _unused(value, _UNSUPPORTED[name]):
                raise InvalidArgumentError(
                    f"{name}={value!r} is not supported with layer_types (a hybrid pool holds plain "
                    "per-head K/V, is not sharded, keeps no retention priorities, maps its metadata "
                    f"at construction and has no host tier): leave it out, or pass {_UNSUPPORTED[name][0]!r}")
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("max_requests", max_requests), ("max_context_len", max_context_len)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = int(num_layers), int(num_kv_heads), int(head_dim)
        self.max_requests, self.max_context_len = int(max_requests), int(max_context_len)
        if not isinstance(layout, str) or layout not in LAYOUTS:
            raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        # The copy kernels that run the core's queued copies take only these: a pool they
        # cannot copy would fail after the core had changed.
        kv_dtypes = [d for d in CACHE_DTYPES if d not in FP8_DTYPES]
        if not isinstance(dtype, torch.dtype) or dtype not in kv_dtypes:
            raise InvalidArgumentError(
                f"dtype must be one of {kv_dtypes} with layer_types (fp8 is the plain pool's only), got {dtype!r}")
        if compute_dtype is not None and (not isinstance(compute_dtype, torch.dtype) or compute_dtype != dtype):
            raise InvalidArgumentError(f"compute_dtype {compute_dtype} differs from dtype {dtype}: only fp8 pools convert")
        self.layout, self.dtype, self.compute_dtype, self.device = layout, dtype, dtype, as_device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"a KVPool lives on a 'cpu' or 'cuda' device, got {self.device}")
        require_triton(self.device)
        self.mla, self.fp8 = False, False
        if num_pages is not None and num_slots is not None:
            raise InvalidArgumentError("pass num_pages or num_slots, not both")
        if num_slots is not None:
            p = page_size.get("full_attention", page_size.get("sliding_attention", 1)) \
                if isinstance(page_size, Mapping) else page_size
            # (a numpy int page size is an int here too, as plan_groups and the plain pool take it)
            if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 1:
                raise InvalidArgumentError(f"num_slots must be a multiple of page_size >= 2 pages, got {num_slots!r} "
                                           f"with page_size {p!r}")
            # (the plain pool's check and hints: a size off the page size names the sizes it takes)
            num_pages = pages_of_slots(num_slots, int(p))
            if num_pages < 2:
                raise InvalidArgumentError(f"num_slots={num_slots} is under two pages of page_size={p}; use {2 * p} "
                                           "(two pages: page 0 is reserved)")
        self.layer_types = tuple(layer_types) if isinstance(layer_types, (list, tuple)) else layer_types
        plan: dict[str, Any] = dict(
            layer_types=layer_types, num_layers=self.num_layers, sliding_window=sliding_window,
            page_size=page_size, group_pages=group_pages, max_requests=self.max_requests,
            max_context_len=self.max_context_len)
        has_state = any(g.kind == "state" for g in plan_groups(num_pages=2, **plan))
        self.state_shapes = plan_states(state_shapes, dtype, has_state)
        if memory_bytes is not None or memory_fraction is not None:
            num_pages = self._budget_pages(num_pages, num_slots, memory_bytes, memory_fraction, plan)
        self.groups: list[LayerGroup] = plan_groups(num_pages=num_pages, **plan)
        check_slot_ids(self.groups, budget=("memory_fraction" if memory_fraction is not None else "memory_bytes"
                                            if memory_bytes is not None else None))
        self.sliding_window = next((g.window for g in self.groups if g.window is not None), None)
        # The core checks every size and seed before any tensor exists.
        self.allocator = GroupedAllocator(
            [g.spec() for g in self.groups], self.max_requests, self.max_context_len, hash_seed=hash_seed,
            handle_seed=handle_seed, kv_events=kv_events)
        self._lock = threading.RLock()
        track_for_fork(self, "_lock", POOL)
        self._init_row_edits()  # (calls that change requests behind a KVPoolCache: kvpool.row_edits)
        group_of = [0] * self.num_layers
        for g in self.groups:
            for layer in g.layers:
                group_of[layer] = g.index
        self.group_of_layer = tuple(group_of)
        self._slot_in_group = {layer: i for g in self.groups for i, layer in enumerate(g.layers)}
        self._storage: list[KVStorage | None] = []
        self._tables: list[torch.Tensor | None] = []
        self._states: list[dict[str, torch.Tensor] | None] = []
        with persistent():
            for g in self.groups:
                if g.kind == "state":
                    self._storage.append(None)
                    self._tables.append(None)
                    nbytes = len(g.layers) * sum(g.num_pages * math.prod(shape) * dt.itemsize
                                                 for shape, dt in self.state_shapes.values())
                    with refuse_out_of_memory(f"group {g.index}'s states", nbytes, self.device,
                                              "use fewer state slots (group_pages) or smaller state_shapes"):
                        self._states.append({
                            f"{layer}.{name}": torch.zeros((g.num_pages,) + shape, dtype=dt, device=self.device)
                            for layer in g.layers for name, (shape, dt) in self.state_shapes.items()})
                    continue
                self._storage.append(KVStorage(
                    num_layers=len(g.layers), num_pages=g.num_pages, page_size=g.page_size,
                    heads=self.num_kv_heads, dim=self.head_dim, dtype=dtype, device=self.device, layout=layout,
                    mla=False))
                rows, stride = self.max_requests + 1, padded_row_stride(self.max_context_len)
                with refuse_out_of_memory(f"group {g.index}'s req_to_token", rows * stride * 4, self.device,
                                          "use a smaller max_requests or max_context_len"):
                    self._tables.append(torch.zeros((rows, stride), dtype=torch.int32,
                                                    device=self.device)[:, : self.max_context_len])
                self._states.append(None)
        self.req_to_token = _LayerTables(self)
        # CPU: the core writes new slots straight into numpy views of the tables
        # inside extend's one crossing; elsewhere the pool scatters them.
        self._tables_np: list[np.ndarray | None] | None = (
            [None if t is None else t.numpy() for t in self._tables] if self.device.type == "cpu" else None)
        # Off the CPU, per sliding group: how far each table row already holds the null
        # page's slots where the window released pages (``_null_released``).
        self._nulled = {g.index: np.zeros(self.max_requests + 1, dtype=np.int64)
                        for g in self.groups if g.kind == "sliding"}
        self.null_row = self.max_requests
        self.copied_slots = 0
        # CUDA: orders the core's queued copies before later hand-outs on other streams.
        self._order: CopyOrder | None = CopyOrder(self.device) if self.device.type == "cuda" else None
        # CUDA: host -> device copies (new slots, copies' ids, table updates) through pinned
        # buffers guarded by events, as the plain pool's: from pageable memory each would sync.
        self._to_device = PinnedRing(self.device).to_device if self.device.type == "cuda" else None
        # open() hands out (and zeroes) slots only in state groups.
        self._open_copies = any(g.kind == "state" for g in self.groups)

    def _budget_pages(self, num_pages: Any, num_slots: Any, memory_bytes: Any, memory_fraction: Any,
                      plan: dict[str, Any]) -> int:
        """Pages of the primary group from a memory budget (the other groups get their need)."""
        if sum(x is not None for x in (num_pages, num_slots, memory_bytes, memory_fraction)) != 1:
            raise InvalidArgumentError("give one of num_pages, num_slots, memory_bytes, memory_fraction")
        # One rule for budgets with the plain pool (capacity.py): engine code passes either the same values.
        if memory_fraction is not None:
            budget = int(free_device_memory(self.device) * fraction_of_memory(memory_fraction))
        else:
            budget = budget_bytes("memory_bytes", memory_bytes)
        token = 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        return primary_pages_for_budget(budget, token_bytes=token, states=self.state_shapes,
                                        table_bytes=(self.max_requests + 1) * padded_row_stride(self.max_context_len) * 4,
                                        **plan)

    # ----- geometry ---------------------------------------------------------------

    def group(self, layer: int) -> LayerGroup:
        """The group ``layer`` belongs to.

        Raises:
            LayerIndexError: ``layer`` is not an int in ``[0, num_layers)``.
        """
        return self.groups[self.group_of_layer[check_layer(layer, self.num_layers)]]

    def _page_group(self, layer: Any) -> LayerGroup:
        return _page_group(self.groups, self.group_of_layer, self.num_layers, layer)

    def _state_group(self, layer: Any) -> LayerGroup:
        g = self.group(layer)
        if g.kind != "state":
            raise InvalidArgumentError(f"layer {layer} is a {g.layer_type} layer: it has K/V pages, not state")
        return g

    def page_size_of(self, layer: int) -> int:
        """Tokens per page of ``layer``'s group."""
        return self._page_group(layer).page_size

    def __repr__(self) -> str:
        groups = ", ".join(
            f"{g.layer_type}(layers={len(g.layers)}, "
            + (f"slots={g.num_pages})" if g.kind == "state" else
               f"pages={g.num_pages}, page_size={g.page_size}" + (f", window={g.window})" if g.window else ")"))
            for g in self.groups)
        return (f"KVPool(hybrid: {groups}; heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, device={self.device}, nbytes={self.nbytes})")

