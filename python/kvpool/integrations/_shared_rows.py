"""What every pool-backed attention layer of a ``KVPoolCache`` answers alike: its rows are the
cache's requests, shared by every layer, so the batch-wide operations belong to the cache."""

from __future__ import annotations

from typing import Any

import torch


class SharedRowsLayer:
    """Mixed in before transformers' ``CacheLayerMixin``; the layer has ``requests`` and ``seen``."""

    requests: Any
    seen: int

    @property
    def batch_size(self) -> int:
        return self.requests.batch_size

    def reset(self) -> None:
        self.seen = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop the whole KVPoolCache (cache.crop), not one layer: rows are shared")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("reorder the whole KVPoolCache (cache.reorder_cache), not one layer")

    def offload(self) -> None:
        raise NotImplementedError("KVPoolCache does not offload: the pool decides where K/V live")
