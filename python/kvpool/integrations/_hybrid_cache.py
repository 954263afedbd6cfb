"""``KVPoolCache`` of a hybrid pool: ``KVPoolCache(pool)`` builds this one when the pool
has layer groups (``KVPool(layer_types=...)``).

Its layers follow the pool's groups (``_hybrid``): full and sliding attention layers,
and linear-attention layers whose state lives in the pool. The model's calls go to
each layer's own ``update`` / ``update_conv_state`` / ``update_recurrent_state``, as
transformers' ``Cache`` dispatches them; the batch-wide operations (crop, reorder,
select, reset) act on the pool's requests as ``KVPoolCache``'s do.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from kvpool.integrations._hybrid import HybridRequests, PoolAttentionLayer, PoolStateLayer, hybrid_layers
from kvpool.integrations.transformers import KVPoolCache

__all__ = ["HybridKVPoolCache"]


class HybridKVPoolCache(KVPoolCache):
    """A ``KVPoolCache`` over a hybrid pool (see ``KVPoolCache`` for the arguments).

    ``prefix_ids=`` opens the rows on the longest prefix every group has cached
    (pages, window, state checkpoint); see docs/hybrid.md.
    """

    def __init__(self, pool: Any, *, prefix_ids: torch.Tensor | None = None, salt: int | None = None,
                 layer_buffers: bool = True) -> None:
        # layer_buffers: KVPoolCache's argument, taken so that KVPoolCache(pool, ...) builds this
        # cache with the same arguments; its layers gather through their groups' tables.
        convs = [n for n in pool.state_shapes if n.startswith("conv")]
        self.requests = HybridRequests(pool)  # type: ignore[assignment]
        layers = hybrid_layers(self.requests, max(1, len(convs)))
        self._pool_layers = [x for x in layers if isinstance(x, PoolAttentionLayer)]  # type: ignore[misc]
        self._state_layers = [x for x in layers if isinstance(x, PoolStateLayer)]
        Cache.__init__(self, layers=layers)
        if prefix_ids is not None:
            self.requests.open_with_prefix(prefix_ids, salt)
            self._set_seen(self.requests.length)
            if self.requests.length > 0:
                for layer in self._state_layers:
                    layer.resume()
        elif salt is not None:
            raise TypeError("salt= only applies with prefix_ids=")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's own ``update`` (its group's slots and window)."""
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def crop(self, tokens_to_remove: int) -> None:
        """As ``KVPoolCache.crop``; the pool refuses (``RollbackUnavailableError``, nothing
        changed) a length whose window it released or that has no state checkpoint."""
        super().crop(tokens_to_remove)
        if self.requests.length == 0:
            for layer in self._state_layers:
                layer.reset()

    def reset(self) -> None:
        """Close every row's request; the cache can then serve a new batch."""
        super().reset()
        for layer in self._state_layers:
            layer.reset()

    def __repr__(self) -> str:
        h = self.requests.handles
        rows = 0 if h is None else h.shape[0]
        return f"KVPoolCache(hybrid, rows={rows}, length={self.requests.length}, pool={self.pool!r})"
