"""vLLM v1's KVCacheManager over its HybridKVCacheCoordinator (a full and a sliding-window group),
driven the way its scheduler drives it.

Imported from the installed ``vllm`` package; nothing here re-implements it. The prefix driver
(``vllm_prefix.py``: a ``Request`` hashed by the engine core's block hasher,
``get_computed_blocks`` + ``allocate_slots``, decode ``allocate_slots(req, 1)`` +
``append_output_token_ids``, ``free``) with its second group: a ``KVCacheConfig`` of a
``FullAttentionSpec`` and a ``SlidingWindowSpec`` of the trace's window, both of the trace's page
size, sharing one block pool of ``num_slots / page_size`` blocks (vLLM's hybrid layout: a block of
either group is the same bytes, so the pool's memory is what kvpool's two groups have together).
``get_computed_blocks`` runs the coordinator's fixed point of the two groups' hits;
``allocate_slots`` frees the sliding group's blocks that fell out of the window
(``remove_skipped_blocks``) before allocating. The worker keeps one ``BlockTable`` per group, as
``MultiGroupBlockTable``, and computes each group's slot mapping.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpool.bench.drivers.base import Requirement
from kvpool.bench.drivers.vllm_prefix import HASH_ALGO, VLLMPrefixDriver

VLLM_SLIDING_WINDOW = Requirement("vllm SlidingWindowSpec")
with VLLM_SLIDING_WINDOW.imports():
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec


class VLLMHybridDriver(VLLMPrefixDriver):
    label = "vLLM v1 KVCacheManager, HybridKVCacheCoordinator (full + sliding window)"
    requires = (VLLM_SLIDING_WINDOW,)

    def kv_cache_groups(self) -> list[Any]:
        sliding = SlidingWindowSpec(block_size=self.cfg.page_size, num_kv_heads=1, head_size=64,
                                    dtype=torch.float16, sliding_window=self.cfg.window)
        return [KVCacheGroupSpec(["full.0"], self.spec), KVCacheGroupSpec(["sliding.0"], sliding)]

    def backend(self) -> str:
        return f"BlockPool shared by both groups, {HASH_ALGO} block hashes"


__all__ = ["VLLMHybridDriver"]
