"""``KVPoolCache`` layers for hybrid pools (``KVPool(layer_types=...)``).

transformers builds one cache layer per model layer from ``config.layer_types``
(``DynamicLayer``, ``DynamicSlidingWindowLayer``, ``LinearAttentionLayer``); these
are the pool-backed equivalents, with the same answers to the model:

- attention layers store the step's K/V in their group's new slots and return the
  rows' K/V gathered through their group's table: every token for a full layer,
  ``[max(0, start - W + 1), end)`` for a sliding one, as ``DynamicSlidingWindowLayer``
  returns them and ``get_mask_sizes`` describes them. The pool's sliding group
  holds only the pages of that window;
- linear-attention layers keep their conv and recurrent states in the pool's state
  rows (``state_slots``), under the names ``conv`` / ``recurrent`` (``conv1`` ... for
  layers with several states). The model updates a conv state in place, so it gets
  a view of the pool's rows when the batch's slots are consecutive, else a working
  copy that is written back before anything reads the pool's rows (a new step's
  extend, fork, cache, truncate, close).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin, get_layer_types_and_kwargs

from kvpool._core import InvalidArgumentError, RollbackUnavailableError
from kvpool.errors import KVPoolError, TensorShapeError
from kvpool.hybrid_plan import LAYER_KINDS
from kvpool.integrations._hybrid_state import PoolStateLayer, state_name
from kvpool.integrations._pool_views import index_tensor
from kvpool.integrations._reorder import batch_mismatch, reorder_hybrid_rows, repeat_prefix_rows
from kvpool.integrations._requests import check_kv_type, check_not_empty, prefix_tokens
from kvpool.integrations._row_checks import check_context, check_rows, close_rows, refuse_broken
from kvpool.integrations._shared_rows import SharedRowsLayer, WeakLayers, check_in_step, with_step_grad
from kvpool.kernels._common import check_dense

__all__ = ["HybridRequests", "PoolAttentionLayer", "PoolStateLayer", "hybrid_layers", "hybrid_pool_kwargs", "state_name"]


class HybridRequests:
    """The batch's pool requests on a hybrid pool: one per row, ``length`` tokens each.

    The first attention layer of a forward extends every row once (all groups);
    each attention group's K/V index for the step is built once, lazily.
    """

    # The cache's attention layers (``KVPoolCache._pool_layers``) and linear-attention layers
    # (``_state_layers``), held weakly: each layer holds these requests (``WeakLayers``).
    layers = WeakLayers()
    state_layers = WeakLayers()

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.device = torch.device(pool.device)
        self.dtype, self.heads, self.head_dim = pool.dtype, pool.num_kv_heads, pool.head_dim
        self.handles: np.ndarray | None = None
        self.prefix_unstarted = False  # rows opened on prefix_ids, no forward since
        self.length = 0
        self.prefix_mode = False
        self.published = -1  # the length cache() was last called at
        self.cached_lens: np.ndarray | None = None  # prefix hits per row, in prefix mode
        self.before = 0  # length when the current step began
        self.steps = 0  # forwards that extended the rows (the state layers stamp their writes with it)
        self.epoch = 0  # bumped whenever the rows or their state slots change
        # The rows were opened in this forward and hold no token yet (a linear-attention layer
        # may have written their state): a first step that fails closes them again.
        self.fresh = False
        self._rows: torch.Tensor | None = None
        self._new: list[torch.Tensor] = []
        self._index: dict[int, torch.Tensor] = {}
        self._edits = 0  # the pool's count of calls that change requests, when last checked (``check_edits``)
        self.broken: str | None = None  # why the rows refuse all but close (``check_broken``)

    @property
    def batch_size(self) -> int:
        if self.handles is None:
            raise AttributeError("no rows yet: the batch size is learned at the first update")
        return int(self.handles.shape[0])

    def check_broken(self, what: str) -> None:
        """Refuse everything but ``reset``/``close`` after a reorder lost rows (``reorder``)."""
        refuse_broken(self.broken, what)

    def ensure_open(self, batch: int) -> None:
        self.check_broken("KVPoolCache.update")  # (every layer's update, attention or state, comes here)
        if self.handles is None:
            self._set_handles(self.pool.open(batch))
            self.fresh = True
        elif batch != self.handles.shape[0] and not repeat_prefix_rows(self, batch):
            raise TensorShapeError(batch_mismatch(batch, self.handles.shape[0]))

    def _set_handles(self, handles: np.ndarray) -> None:
        self.handles = np.ascontiguousarray(handles, dtype=np.int64)
        self.prefix_unstarted = False  # (open_with_prefix sets it once the rows are in place)
        # Through the pool's pinned ring (CUDA): from pageable memory the copy would sync.
        self._rows = index_tensor(self.pool.rows(self.handles).astype(np.int64), getattr(self.pool, "_to_device", None),
                                  self.device)
        self._index = {}
        self._edits = getattr(self.pool, "_row_edits", 0)  # (the cache's own calls)
        self.epoch += 1
        for layer in self.state_layers:  # opened, truncated (state restored) or reordered: in step
            layer.sync()

    def check_edits(self, *, lengths: bool = True) -> None:
        """As ``BatchRequests.check_edits``: after a pool call the cache did not make named the
        rows, refuse a change it cannot follow (closed, or with ``lengths`` truncated) before
        anything writes their states or K/V (another request may hold their slots now), and
        read their state slots again (``epoch``). One int compare when nothing changed."""
        pool, handles = self.pool, self.handles
        now = getattr(pool, "_row_edits", 0)
        if now == self._edits:
            return
        if handles is not None and handles.shape[0] and pool._edited_since(self._edits, handles):
            check_rows(pool, handles, self.length if lengths else None)
            self._index = {}
            self.epoch += 1
        self._edits = now

    def flush(self) -> None:
        """Write every state layer's working copy back to the pool's rows (refused, nothing
        written, when they were closed through the pool: ``check_edits``). Locked from the check to
        the writes: a close by another thread in between could give their state slots to another."""
        with self.pool._lock:
            self.check_edits(lengths=False)
            for layer in self.state_layers:
                layer.flush()

    def check_kv(self, key_states: Any, value_states: Any) -> None:
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.shape[1] != self.heads or \
                    x.shape[3] != self.head_dim:
                got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise TensorShapeError(
                    f"{name} must be [batch, {self.heads}, tokens, {self.head_dim}] "
                    f"(the pool's geometry; pool_for_model(model) sizes it), got {got}")
            check_kv_type(name, x, self.dtype, self.device)  # (the plain cache's error classes)
            check_dense(x, name)
        if key_states.shape != value_states.shape:
            raise TensorShapeError(f"key_states {list(key_states.shape)} and value_states "
                                   f"{list(value_states.shape)} differ")
        check_not_empty(key_states)

    def begin_step(self, tokens: int) -> None:
        """Extend every row by ``tokens`` in every group (all-or-nothing)."""
        assert self.handles is not None
        self.prefix_unstarted = False
        check_in_step(self.layers, self.length, "a new forward")
        self.check_edits()
        self.check_states("a new forward", started=True)
        self.publish()
        self.flush()
        try:
            with self.pool._lock:
                # Checked again with the extend under the pool's lock, as the plain cache's step: another
                # thread's truncate or close of the rows since the check above would go unseen, and the
                # step would extend rows whose length it no longer knows.
                self.check_edits()
                check_context(self.pool, self.length, tokens)
                ext = self.pool.extend(self.handles, tokens)
        except BaseException:
            if self.fresh:
                self.close()
                for layer in self.state_layers:
                    layer.reset()
            raise
        self.fresh = False
        self.steps += 1
        self.before, self.length = self.length, self.length + tokens
        self._new = [loc.to(torch.int64) for loc in ext.out_cache_loc]
        self._index = {}

    def publish(self) -> None:
        """In prefix mode, once per length: the previous step has run, so publish its
        pages, and its state as a checkpoint when the length is on the hit step.
        Called by the step's first attention layer before it extends, and by the
        state layers in front of it before they change their rows."""
        if self.prefix_mode and self.length > 0 and self.published != self.length and self.complete():
            assert self.handles is not None
            self.flush()
            self.pool.cache(self.handles)
            self.published = self.length

    def check_states(self, what: str, *, started: bool) -> None:
        """Raise ``IncompleteForwardError`` when a linear-attention layer's state took a forward
        the attention layers did not, or missed one (``started``: this forward's layers in
        front of the first attention layer have run)."""
        for layer in self.state_layers:
            layer.check(what, started=started)

    def complete(self) -> bool:
        """Whether every attention layer stored the rows' tokens (not so after a forward cut
        short, whose pages and state must then never be published)."""
        return all(layer.seen == self.length for layer in self.layers)

    def new_slots(self, group: int) -> torch.Tensor:
        return self._new[group]

    def first(self, window: int | None) -> int:
        """First position an attention layer sees this step: 0, or the window's start."""
        return 0 if window is None else max(0, self.before - window + 1)

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' K/V of ``layer`` as ``[B, H, n, D]``: every position for a full
        layer, the step's window for a sliding one (gathered through the group's table)."""
        g = self.pool.group(layer)
        idx = self._index.get(g.index)
        if idx is None:
            assert self._rows is not None
            lo = self.first(g.window)
            # Kept for the step's other layers and until the next step, which may run under
            # another grad mode: a normal tensor, as index_tensor makes them.
            with torch.inference_mode(False):
                idx = self.pool.req_to_token[layer][self._rows, lo: self.length].to(torch.int64)
            self._index[g.index] = idx
        b, n = idx.shape
        flat = idx.reshape(-1)
        k = self.pool.k_buffer(layer).view(-1, self.heads, self.head_dim).index_select(0, flat)
        v = self.pool.v_buffer(layer).view(-1, self.heads, self.head_dim).index_select(0, flat)
        return k.view(b, n, self.heads, self.head_dim).transpose(1, 2), \
            v.view(b, n, self.heads, self.head_dim).transpose(1, 2)

    # -- whole-batch edits --------------------------------------------------------------
    def truncate(self, length: int) -> None:
        if self.handles is None or length == self.length:
            return
        if not 0 <= length < self.length:
            raise InvalidArgumentError(f"cannot crop to {length} tokens: the cache holds {self.length}")
        self.check_edits(lengths=False)  # (a crop to rows truncated through the pool goes on from there)
        self.flush()
        self.pool.truncate(self.handles, np.full(self.handles.shape[0], length, dtype=np.int64))
        self.length = self.before = length
        self._set_handles(self.handles)  # a restore may move a state slot

    def reorder(self, sources: list[int]) -> None:
        """Row j continues row ``sources[j]`` (a fork per extra copy, state included)."""
        reorder_hybrid_rows(self, sources)

    def open_with_prefix(self, prefix_ids: torch.Tensor, salt: int | None) -> None:
        """Open one request per row of ``prefix_ids`` [B, T] on its longest cached prefix
        (every group's: pages, window, state checkpoint). Rows share one length, so
        all keep the shortest hit; when a row cannot go back to it (a sliding window
        that released the pages the shorter window needs, no state checkpoint there)
        every row starts empty. Either way the rows keep their prompts."""
        b, t, tokens = prefix_tokens(prefix_ids)  # (checked as on a plain pool)
        handles, cached = self.pool.open_with_prefix(tokens, np.full(b, t, dtype=np.int64), salt=salt)
        cached = np.asarray(cached, dtype=np.int64)
        common = int(cached.min())
        if int(cached.max()) > common:
            # Keeping the prompts: the rows recompute their prompts past the cut from the
            # prompts' token ids, so close(cache=True) publishes them in every group (truncate,
            # or rows opened again, would make them unknown positions). Back to 0 needs no
            # window and no checkpoint (the empty state), so only running out of state slots
            # for a restore can refuse it.
            try:
                try:
                    self.pool._truncate_keeping_prompts(handles, np.full(b, common, dtype=np.int64))
                except RollbackUnavailableError:
                    common = 0
                    self.pool._truncate_keeping_prompts(handles, np.zeros(b, dtype=np.int64))
            except BaseException:
                self.pool.close(handles)
                raise
        self._set_handles(handles)
        self.length = self.before = self.published = common
        self.prefix_mode, self.cached_lens = True, cached
        self.prefix_unstarted = True  # until a forward: generate may still expand the batch

    def close(self) -> None:
        broken, self.broken = self.broken, None  # (its rows go with the rest)
        if self.handles is not None:
            with self.pool._lock:  # (from the check to the close: as flush, which then checks nothing)
                try:
                    self.check_edits(lengths=False)
                    intact = broken is None  # (a reorder that lost rows: nothing of them to publish)
                except KVPoolError:  # closed through the pool: their state slots may be another's now
                    intact = False
                handles, self.handles, self._rows = self.handles, None, None
                if intact and self.prefix_mode and self.length > 0 and self.complete():
                    self.flush()  # the checkpoint close(cache=True) takes reads the pool's rows
                    self.flush_discard()
                    close_rows(self.pool, handles, True)
                else:
                    self.flush_discard()
                    close_rows(self.pool, handles, False)
        self.length = self.before = 0
        self.prefix_mode, self.cached_lens, self.fresh = False, None, False
        self.epoch += 1

    def flush_discard(self) -> None:
        for layer in self.state_layers:
            layer.drop()


class PoolAttentionLayer(SharedRowsLayer, CacheLayerMixin):
    """A full or sliding attention layer whose K/V live in the pool's group for it."""

    is_compileable = False
    is_croppable = True

    def __init__(self, requests: HybridRequests, layer_idx: int, window: int | None) -> None:
        super().__init__()
        self.requests, self.layer_idx, self.seen = requests, layer_idx, 0
        self.group = requests.pool.group(layer_idx).index
        self.sliding_window = window
        self.is_sliding = window is not None
        self.device = requests.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's K/V and return the rows' K/V this layer attends to (new tensors)."""
        req = self.requests
        req.check_kv(key_states, value_states)
        req.ensure_open(key_states.shape[0])
        self.is_initialized = True
        tokens = key_states.shape[2]
        self.join_step(tokens)
        req.pool._store_bhtd(self.layer_idx, req.new_slots(self.group), key_states.detach(), value_states.detach())
        self.seen += tokens
        kv = req.kv(self.layer_idx)
        if key_states.requires_grad or value_states.requires_grad:
            return with_step_grad(kv, key_states, value_states)
        return kv

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # As DynamicSlidingWindowLayer: the window's start and everything after it.
        offset = 0 if self.sliding_window is None else max(self.seen - self.sliding_window + 1, 0)
        return self.seen + query_length - offset, offset

    def get_max_length(self) -> int:
        return self.sliding_window if self.sliding_window is not None else int(self.requests.pool.max_context_len)


def hybrid_layers(requests: HybridRequests, number_of_states: int = 1) -> list[Any]:
    """One cache layer per pool layer, by the layer's group."""
    out: list[Any] = []
    for layer in range(requests.pool.num_layers):
        g = requests.pool.group(layer)
        if g.kind == "state":
            out.append(PoolStateLayer(requests, layer, number_of_states))
        else:
            out.append(PoolAttentionLayer(requests, layer, g.window))
    return out


def hybrid_pool_kwargs(text_config: Any, max_context_len: int) -> dict[str, Any]:
    """``layer_types`` / ``sliding_window`` / ``state_shapes`` for ``KVPool`` from a decoder
    config, read as transformers' own ``DynamicCache(config=...)`` reads it; empty for
    a model whose every layer has full attention (the plain pool). A window at least
    ``max_context_len`` long never slides, so its layers count as full.

    State shapes are known for Qwen3-Next-style gated-delta-net layers (``linear_*``
    config fields); for other linear-attention or Mamba layers pass ``state_shapes=``.
    """
    types, per_layer = get_layer_types_and_kwargs(text_config)
    # "dummy" is transformers' name for a layer that stores nothing: one that reuses an earlier
    # layer's K/V, or one without attention (layer types "moe" / "mlp", as Nemotron-H's).
    dummy = [i for i, t in enumerate(types) if t == "dummy"]
    given = list(getattr(text_config, "layer_types", None) or [])
    no_attention = [i for i in dummy if i < len(given) and given[i] in ("moe", "mlp")]
    shared = [i for i in dummy if i not in no_attention]
    if shared:
        raise InvalidArgumentError(
            f"layers {shared} share an earlier layer's K/V (KV sharing, as Gemma 3n's num_kv_shared_layers) "
            "and never store their own; a KVPool has K/V for every layer: use transformers' DynamicCache")
    if no_attention:
        raise InvalidArgumentError(
            f"layers {no_attention} have no attention (layer types 'moe' / 'mlp', as Nemotron-H's) and keep "
            "no cache; a KVPool gives every layer K/V or a state: use transformers' DynamicCache")
    unknown = {t: [i for i, u in enumerate(types) if u == t] for t in types if t not in LAYER_KINDS}
    if unknown:  # (as Llama 4's chunked_attention, Zamba's hybrid, LFM's conv layers)
        raise InvalidArgumentError(
            "the model has layers of types a KVPool cannot hold ("
            + "; ".join(f"{t!r}: layers {at}" for t, at in unknown.items())
            + f"; it holds {sorted(LAYER_KINDS)}): use transformers' DynamicCache for this model")
    types = ["full_attention" if t == "sliding_attention" and kw["sliding_window"] >= max_context_len else t
             for t, kw in zip(types, per_layer)]
    if all(t == "full_attention" for t in types):
        return {}
    windows = {kw["sliding_window"] for t, kw in zip(types, per_layer) if t == "sliding_attention"}
    if len(windows) > 1:
        raise InvalidArgumentError(f"the model's sliding layers have windows {sorted(windows)}; a pool has one window")
    out: dict[str, Any] = {"layer_types": list(types)}
    if windows:
        out["sliding_window"] = int(windows.pop())
    if any(t in ("linear_attention", "mamba") for t in types):
        c = text_config
        if all(hasattr(c, a) for a in ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
                                       "linear_value_head_dim", "linear_conv_kernel_dim")):
            key_dim = c.linear_num_key_heads * c.linear_key_head_dim
            value_dim = c.linear_num_value_heads * c.linear_value_head_dim
            # A float32 recurrent state, as the gated delta rule's kernels return it and DynamicCache keeps it.
            out["state_shapes"] = {
                "conv": (2 * key_dim + value_dim, c.linear_conv_kernel_dim),
                "recurrent": ((c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim), torch.float32),
            }
    return out
