"""Linear-attention cache layers of a hybrid ``KVPoolCache`` (see ``_hybrid``).

A layer's conv and recurrent states live in the pool's state rows
(``pool.state(layer, name)``, row ``state_slots``), named ``conv`` / ``recurrent``
(``conv1`` ... for a layer with several states). The model updates a conv state
in place (``causal_conv1d_update``), so it gets a view of the pool's rows when
the batch's slots are consecutive, else a working copy that is written back
(``flush``) before anything reads the pool's rows: the next step's extend, fork,
truncate.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import numpy as np
import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from kvpool.errors import IncompleteForwardError, InvalidArgumentError, KVPoolError, TensorDtypeError, TensorShapeError
from kvpool.integrations._pool_views import index_tensor
from kvpool.integrations._shared_rows import check_in_step
from kvpool.modes import persistent

__all__ = ["PoolStateLayer", "state_name"]


class StateRequests(Protocol):
    """What a state layer reads of the cache's requests (``_hybrid.HybridRequests``), named
    here so that this module does not import the one that builds its layers."""

    pool: Any
    device: torch.device
    dtype: torch.dtype
    handles: np.ndarray | None
    state_layers: list[Any]
    layers: list[Any]
    length: int
    epoch: int
    steps: int
    prefix_unstarted: bool  # rows opened on prefix_ids, no forward since (generate may expand them)

    @property
    def batch_size(self) -> int: ...

    def ensure_open(self, batch: int) -> None: ...

    def check_broken(self, what: str) -> None: ...

    def check_edits(self) -> None: ...

    def publish(self) -> None: ...


def state_name(kind: str, state_idx: int) -> str:
    """Pool state name of a layer's ``state_idx``-th conv or recurrent state."""
    return kind if state_idx == 0 else f"{kind}{state_idx}"


class _StateRows(dict):
    """``conv_states`` / ``recurrent_states`` of a ``PoolStateLayer``: entry i is the batch's
    rows of the pool's state tensor (a view, or a working copy written back later).

    Holds its layer weakly: the layer holds it, and a cycle kept a dropped cache's requests and
    pool (its K/V and states) alive until the cyclic collector ran."""

    def __init__(self, layer: PoolStateLayer, kind: str, n: int) -> None:
        super().__init__({i: None for i in range(n)})
        self._ref, self._kind = weakref.ref(layer), kind

    @property
    def _layer(self) -> PoolStateLayer:
        layer = self._ref()
        if layer is None:
            raise InvalidArgumentError(f"these {self._kind} states belong to a cache layer that is gone (its "
                                       f"KVPoolCache was dropped): read them from a live cache")
        return layer

    def __getitem__(self, i: int) -> Any:
        layer = self._layer  # (once: each read of the weak reference costs a property call)
        if layer.requests.handles is None or not layer.initialized(self._kind, i):
            return None
        return layer.rows(state_name(self._kind, i))

    def __setitem__(self, i: int, value: Any) -> None:
        if value is None or not hasattr(self, "_ref"):
            return super().__setitem__(i, value)
        self._layer.rows(state_name(self._kind, i)).copy_(value)


class PoolStateLayer(LinearAttentionCacheLayerMixin):
    """A linear-attention layer whose conv / recurrent states live in the pool's state rows."""

    is_compileable = False
    # A crop restores the state only at a length the pool keeps a checkpoint for (cache(), at
    # page multiples), not at any length: generate must not count on it. transformers >= 5.25
    # runs assisted decoding (assistant models, prompt lookup) on linear-attention models when
    # every layer says it crops, and its crops then raised RollbackUnavailableError mid-way;
    # now generate refuses up front with its own ValueError (5.24 refused stateful models).
    is_croppable = False

    def __init__(self, requests: StateRequests, layer_idx: int, number_of_states: int = 1) -> None:
        # transformers >= 5.25 gives the layer a token counter (``cumulative_length_linear``) of
        # its own; this layer neither reads nor bumps it (get_seq_length, increase_count), but it
        # is a tensor the cache keeps, so it is made outside the caller's inference mode.
        with persistent():
            super().__init__(number_of_states=number_of_states)
        self.requests, self.layer_idx = requests, layer_idx
        self.conv_states = _StateRows(self, "conv", number_of_states)
        self.recurrent_states = _StateRows(self, "recurrent", number_of_states)
        self.device, self.dtype = requests.device, requests.dtype  # type: ignore[assignment]
        pool = requests.pool
        self.before_attention = all(pool.group(i).kind == "state" for i in range(layer_idx))
        self._epoch = -1
        self._rows: dict[str, torch.Tensor] = {}
        self._work: dict[str, torch.Tensor] = {}  # working copies to write back
        self._slots: torch.Tensor | None = None
        # The number of forwards (``requests.steps``) this layer's state has taken, and the states
        # the model wrote in the last of them (a decode step may update a conv state in place,
        # writing only the recurrent one here). The model updates a state in place, so a forward
        # cut short can leave it a step ahead of the rows, or behind: ``stamp`` and ``check``
        # refuse to build on that.
        self._stamp: int | None = None
        self._written: set[str] = set()
        # The states the model read in that forward (``touch``): a model may update a read state
        # in place without ever calling update_* (Jamba's Mamba decode updates both so).
        self._read: set[str] = set()
        self._last: tuple[Any, ...] = (None, set(), set())  # (the three as the last forward left them)

    def initialized(self, kind: str, i: int) -> bool:
        flags = self.is_conv_states_initialized if kind == "conv" else self.is_recurrent_states_initialized
        return bool(flags[i])

    def _refresh(self) -> None:
        req = self.requests
        # A reorder that lost rows (``_reorder.lost_rows``), or a call through the pool, may have
        # closed the rows and handed their state slots to another request: refused before the
        # model gets (and writes) them.
        req.check_broken("KVPoolCache.update")
        req.check_edits()
        if self._epoch == req.epoch:  # (the common case: no write-back, so no lock)
            return
        with req.pool._lock:  # from the check to the write-back, as HybridRequests.flush
            req.check_edits()
            self.flush()
        assert req.handles is not None
        slots = req.pool.state_slots(req.handles, self.layer_idx)
        # Through the pool's pinned ring (CUDA): from pageable memory the copy would sync.
        self._slots = index_tensor(slots.astype(np.int64), getattr(req.pool, "_to_device", None), self.device)
        s0 = int(slots[0]) if slots.shape[0] else 0
        self._consecutive = bool((slots == np.arange(s0, s0 + slots.shape[0])).all())
        self._s0 = s0
        self._rows, self._work = {}, {}
        self._epoch = req.epoch

    def rows(self, name: str) -> torch.Tensor:
        """The batch's rows of the pool's state ``name`` ([B, *shape])."""
        if self.before_attention:
            # This layer runs before the step's extend: the rows still hold the state
            # at the current length, which a checkpoint must capture first.
            self.requests.publish()
        self._refresh()
        t = self._rows.get(name)
        # Under grad mode the model copies states with autograd history into what it gets, in
        # place: a view would pass that history to the pool's tensor, so it gets a working
        # copy, written back without the history.
        if t is None or (name not in self._work and torch.is_grad_enabled()):
            full = self.requests.pool.state(self.layer_idx, name)
            assert self._slots is not None
            if self._consecutive and not torch.is_grad_enabled():
                t = full[self._s0: self._s0 + self._slots.shape[0]]
            else:
                t = full.index_select(0, self._slots)
                self._work[name] = t
            self._rows[name] = t
        return t

    def flush(self) -> None:
        """Write working copies back to the pool and forget them (views need nothing): the
        next access gathers again, so a later change in the pool (a restore) is seen."""
        if self._work and self._slots is not None:
            for name, t in self._work.items():
                self.requests.pool.state(self.layer_idx, name).index_copy_(0, self._slots, t.detach())
                del self._rows[name]
        self._work = {}

    def sync(self) -> None:
        """The rows' states are in step with their length (opened, restored, reordered)."""
        self._stamp, self._written, self._read = None, set(), set()

    def stamp(self, name: str, *, read: bool = False) -> None:
        """Before the model writes state ``name`` (or, ``read``, gets its previous state, which it
        may then update in place): refuse (``IncompleteForwardError``, nothing written) a write
        that would take a forward twice or build on a forward cut short."""
        req = self.requests
        if self.before_attention:  # runs before this forward's attention layers extend the rows
            check_in_step(req.layers, req.length, "a new forward")
            now = req.steps + 1
        else:
            now = req.steps
        if self._stamp == now:  # another state of this forward, or the one it read now written
            if name in self._written or (read and name in self._read):
                raise self._out_of_step("a new forward")  # again: the last forward was cut short
        elif self._stamp is None or self._stamp == now - 1:  # the first state this forward touches
            self._last = (self._stamp, self._written, self._read)
            self._stamp, self._written, self._read = now, set(), set()
        else:  # a forward missed
            raise self._out_of_step("a new forward")
        (self._read if read else self._written).add(name)

    def check(self, what: str, *, started: bool) -> None:
        want = self.requests.steps + (1 if started and self.before_attention else 0)
        if self._stamp is not None and self._stamp != want:
            raise self._out_of_step(what)

    def _out_of_step(self, what: str) -> IncompleteForwardError:
        return IncompleteForwardError(
            f"{what}: the last forward was cut short, and linear-attention layer {self.layer_idx}'s state, "
            "which the model updates in place, no longer matches the rows' length. crop to a length the "
            "pool keeps a state checkpoint for (it restores the state there), or reset() the cache")

    def drop(self) -> None:
        self._work, self._rows, self._epoch = {}, {}, -1

    def get_seq_length(self) -> int:
        # transformers >= 5.25 asks layer 0 for the cache's length even when it is a linear-attention
        # layer, which it counts in a tensor of its own; before, it asked the first attention
        # layer. The rows' length is the pool's: answer as that layer does.
        layers = self.requests.layers
        return int(layers[0].get_seq_length()) if layers else self.requests.length

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Declined: recording would have the model compute the states after each of a forward's
        last tokens (``get_recurrent_states_to_keep``) for crops this layer cannot take."""

    def increase_count(self, state_idx: int) -> None:
        """(transformers >= 5.25) a decode step's in-place conv update: nothing to count, the
        attention layers' extends keep the rows' length."""

    def lazy_initialization(self, conv_states: torch.Tensor | None = None, recurrent_states: torch.Tensor | None = None,
                            state_idx: int = 0, conv_kernel_size: int | None = None) -> None:
        given = conv_states if conv_states is not None else recurrent_states
        assert given is not None
        batch = given.shape[0]
        self.requests.ensure_open(batch)
        for kind, x in (("conv", conv_states), ("recurrent", recurrent_states)):
            if x is None:
                continue
            want = self.requests.pool.state(self.layer_idx, state_name(kind, state_idx)).shape[1:]
            got = x.shape[1:] if kind == "recurrent" else x.shape[1:-1]
            if tuple(got) != tuple(want[: len(got)]):
                raise TensorShapeError(
                    f"layer {self.layer_idx}'s {kind} state is {list(x.shape[1:])} per row; the pool holds "
                    f"{list(want)} (state_shapes[{state_name(kind, state_idx)!r}])")
            if kind == "conv":
                self.conv_kernel_size[state_idx] = int(want[-1])
                self.is_conv_states_initialized[state_idx] = True
            else:
                self.is_recurrent_states_initialized[state_idx] = True

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
        """An attention layer's update on this layer: the model is not the pool's."""
        raise InvalidArgumentError(
            f"KVPoolCache.update: layer {self.layer_idx} of the pool is a linear-attention (state) layer (its "
            f"layer_types are {list(self.requests.pool.layer_types)}), but the model stores attention K/V there: the "
            "pool was built for another model; build it for this one (pool_for_model(model))")

    def _check_new(self, kind: str, x: Any, state_idx: int) -> None:
        """The model's new ``kind`` state: a floating tensor of the pool's per-row shape (a conv state:
        any number of columns) for the rows, else the typed error before anything changes. Rows
        opened on ``prefix_ids`` may take generate's expansion of the batch (``ensure_open``)."""
        try:
            self._check_state(kind, x, state_idx)
        except KVPoolError:
            # Refused before anything changed: a get_conv_state / get_recurrent_state of this forward (the
            # model's first call here) counted it as touching the state, which would refuse the next one.
            if not self._written and self._stamp == self.requests.steps + (1 if self.before_attention else 0):
                self._stamp, self._written, self._read = self._last
            raise

    def _check_state(self, kind: str, x: Any, state_idx: int) -> None:
        name = state_name(kind, state_idx)
        full = self.requests.pool.state(self.layer_idx, name)
        want = tuple(full.shape[1:-1] if kind == "conv" else full.shape[1:])
        got = tuple(x.shape[1:-1] if kind == "conv" else x.shape[1:]) if isinstance(x, torch.Tensor) else None
        if got != want or x.ndim != full.ndim:
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise TensorShapeError(
                f"layer {self.layer_idx}'s new {kind} state must be [batch, {', '.join(map(str, want))}"
                f"{', columns' if kind == 'conv' else ''}] (state_shapes[{name!r}]), got {shape}")
        if x.is_floating_point() != full.is_floating_point() or x.is_complex() != full.is_complex():
            raise TensorDtypeError(f"layer {self.layer_idx}'s new {kind} state is {x.dtype}; the pool keeps it as "
                                   f"{full.dtype} (state_shapes[{name!r}]): give the state its dtype there")
        handles = self.requests.handles
        if self.requests.prefix_unstarted or (handles is not None and x.shape[0] != handles.shape[0]):
            self.requests.ensure_open(x.shape[0])  # (the batch's size checked, or generate's expansion taken)

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs: Any) -> torch.Tensor:
        """As ``LinearAttentionLayer.update_conv_state``, keeping the last kernel-size columns in the pool."""
        self._check_new("conv", conv_states, state_idx)
        if not self.is_conv_states_initialized[state_idx]:
            self.lazy_initialization(conv_states=conv_states, state_idx=state_idx)
        self.stamp(state_name("conv", state_idx))
        rows = self.rows(state_name("conv", state_idx))
        k = rows.shape[-1]
        if not self.has_previous_state[state_idx]:
            full = conv_states
            self.has_previous_state[state_idx] = True
            if full.shape[-1] < k:
                full = torch.nn.functional.pad(full, (k - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([rows, conv_states], dim=-1)
        rows.copy_(full[..., -k:])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor | list[torch.Tensor], state_idx: int = 0,
                               **kwargs: Any) -> torch.Tensor:
        if isinstance(recurrent_states, (list, tuple)) and recurrent_states:
            # transformers >= 5.25, recording the past (activate_past_recording): the states after
            # each of the forward's last tokens. A crop here restores the pool's checkpoints
            # instead, so only the last state is kept.
            recurrent_states = recurrent_states[-1]
        # Rows opened on prefix_ids are resumed (initialized) without a forward, and a model whose first
        # layer is a state layer reaches here before any attention layer: generate's expansion of the
        # batch (beam search, num_return_sequences) is taken as on an attention layer (repeat_prefix_rows).
        self._check_new("recurrent", recurrent_states, state_idx)
        assert isinstance(recurrent_states, torch.Tensor)  # (checked there)
        if not self.is_recurrent_states_initialized[state_idx]:
            self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
        self.stamp(state_name("recurrent", state_idx))
        name = state_name("recurrent", state_idx)
        rows = self.rows(name)
        if torch.is_grad_enabled() and name in self._work:
            # The model saved the state it read this forward (this working copy) for its backward:
            # the decay multiplies it. Written over in place, that backward raised ("modified by an
            # inplace operation"); the new state replaces the copy instead: a copy in the pool's dtype
            # without autograd history (the pool stays out of autograd; the model's tensor stays its own).
            self._work[name] = self._rows[name] = recurrent_states.detach().to(rows.dtype, copy=True)
            return recurrent_states.to(rows.dtype)
        rows.copy_(recurrent_states)
        return rows

    def resume(self) -> None:
        """Rows opened on a cached prefix: the pool's rows hold the state at that length."""
        pool = self.requests.pool
        for i in range(self.number_of_states):
            for kind in ("conv", "recurrent"):
                name = state_name(kind, i)
                if name not in pool.state_shapes:
                    continue
                if kind == "conv":
                    self.conv_kernel_size[i] = pool.state_shapes[name][0][-1]
                    self.is_conv_states_initialized[i] = True
                else:
                    self.is_recurrent_states_initialized[i] = True
            self.has_previous_state[i] = True

    @property
    def batch_size(self) -> int:
        return self.requests.batch_size

    def reset(self) -> None:
        # Not initialized either: after the cache's rows are closed, the next batch's first
        # state update must go through lazy_initialization, which opens its rows.
        self.drop()
        for i in range(self.number_of_states):
            self.has_previous_state[i] = False
            self.is_conv_states_initialized[i] = False
            self.is_recurrent_states_initialized[i] = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("reorder the whole KVPoolCache (cache.reorder_cache), not one layer")

    def offload(self) -> None:
        raise NotImplementedError("KVPoolCache does not offload: the pool decides where state lives")

    def prefetch(self) -> None:
        pass
