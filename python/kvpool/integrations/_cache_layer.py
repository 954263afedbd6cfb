"""``KVPoolLayer``: one model layer's ``CacheLayerMixin`` over a ``KVPoolCache``'s requests.

Each layer's ``update`` stores the step's K/V into the pool and returns the rows' full
K/V; the batch's requests (``_requests.BatchRequests``) are shared by every layer.
Public as ``kvpool.integrations.transformers.KVPoolLayer`` (imported through that
module, which checks the transformers version first).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpool.integrations._requests import BatchRequests
from kvpool.integrations._shared_rows import SharedRowsLayer, owned, with_step_grad

__all__ = ["FixedLayerKinds", "KVPoolLayer"]


class KVPoolLayer(SharedRowsLayer, CacheLayerMixin):
    """One model layer's view of the shared pool requests.

    ``seen`` counts the tokens this layer has stored. The first layer whose ``seen``
    equals the batch's length starts a new step (extends every row); the others find
    the step already started and write into its slots.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, requests: BatchRequests, layer_idx: int) -> None:
        super().__init__()
        self.requests, self.layer_idx, self.seen = requests, layer_idx, 0
        self.device = requests.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # The storage is the pool's; nothing to allocate. ``keys``/``values`` stay None.
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's K/V [B, kv_heads, T, head_dim] and return the rows' full K/V (views
        of the pool or the cache's buffers, valid until the next ``update``; copies under grad mode).

        Raises the pool's typed errors (``PoolExhaustedError``, ``ContextTooLongError``,
        ``TooManyRequestsError``, ``TensorShapeError``/``TensorDtypeError``), or
        ``IncompleteForwardError`` after a forward cut short, before anything is stored.
        """
        req = self.requests
        req.check_broken("KVPoolCache.update")
        if not req.kv_ok(key_states, value_states):
            req.check_kv(key_states, value_states)
            req.ensure_open(key_states.shape[0])
        self.is_initialized = True  # the storage is the pool's; ``keys``/``values`` stay None
        tokens = key_states.shape[2]
        self.join_step(tokens)
        live = None
        if key_states.requires_grad or value_states.requires_grad:
            # Stores must not drag the pool's caches into autograd; what attention gets does
            # carry the step's own K/V history (``with_step_grad``).
            live = key_states, value_states
            key_states, value_states = key_states.detach(), value_states.detach()
        dst, store = req.dst, req.store
        if dst is not None:  # the step's slots are one strided run: plain copies, K/V checked above
            dst[0][self.layer_idx].copy_(key_states)
            dst[1][self.layer_idx].copy_(value_states)
        elif req.later:  # stored from the layer buffers (pages.kv adds it) at the next flush
            pass
        elif store is not None:  # the pool's store alone: kv_ok / check_kv checked the K/V
            store(self.layer_idx, req.new_slots, key_states, value_states)
        else:
            req.write(self.layer_idx, key_states, value_states)
        self.seen += tokens
        pages = req.pages
        kv = req.gather(self.layer_idx) if pages is None else pages.kv(self.layer_idx, key_states, value_states)
        if live is not None:
            return with_step_grad(kv, *live, own=pages is not None)
        return owned(kv) if req.grad and pages is not None else kv  # (an fp8 pool's gather: new tensors)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return int(self.requests.pool.max_context_len)


class FixedLayerKinds:
    """``Cache``'s ``is_compileable``, ``is_sliding``, ``is_linear`` and ``is_dummy``, taken once.

    transformers reads them at every forward (``generate``'s inputs read ``is_compileable``, the
    masks all four), and ``Cache`` computes each by walking the layers: about 10 µs a decode step
    for a 4-layer model, some 0.4% of a batch-1 step of the bench's small Llama. A ``KVPoolCache``'s
    layers are made with it and never change kind, so the cache takes the answers from ``Cache``'s
    own properties once, at the end of its ``__init__`` (``_fix_layer_kinds``); each read of a list
    returns a new list, as ``Cache``'s do. Before that (and on a cache whose ``layers`` no longer
    hold the same layer objects) the reads are ``Cache``'s own."""

    layers: list[Any]
    _kinds: tuple[list[Any], bool, tuple[tuple[bool, ...], ...]] | None = None

    def _fix_layer_kinds(self) -> None:
        own = [getattr(Cache, name).fget(self) for name in ("is_compileable", "is_sliding", "is_linear", "is_dummy")]
        self._kinds = (list(self.layers), own[0], tuple(tuple(x) for x in own[1:]))

    def _kind(self, i: int, name: str) -> Any:
        k = self._kinds
        if k is None or k[0] != self.layers:  # (the same layer objects: list == compares by identity first)
            return getattr(Cache, name).fget(self)
        return k[1] if i < 0 else list(k[2][i])

    @property
    def is_compileable(self) -> bool:
        return self._kind(-1, "is_compileable")  # type: ignore[no-any-return]

    @property
    def is_sliding(self) -> list[bool]:
        return self._kind(0, "is_sliding")  # type: ignore[no-any-return]

    @property
    def is_linear(self) -> list[bool]:
        return self._kind(1, "is_linear")  # type: ignore[no-any-return]

    @property
    def is_dummy(self) -> list[bool]:
        return self._kind(2, "is_dummy")  # type: ignore[no-any-return]
