"""What vLLM's drivers share: the worker's real ``BlockTable`` and the slot mapping it yields.

Imported from the installed ``vllm`` package; nothing here re-implements it.
The slot mapping is computed on the host with numpy, as vLLM's model runner
computed it before moving it into a Triton kernel (that kernel cannot run on a
CPU host).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool.bench.drivers.base import Driver, Requirement, storage_bytes

VLLM_BLOCK_TABLE = Requirement("vllm BlockTable")
with VLLM_BLOCK_TABLE.imports():
    import logging

    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.block_table import BlockTable

    logging.getLogger("vllm").setLevel(logging.WARNING)


class VLLMBase(Driver):
    package = "vllm"
    requires = (VLLM_BLOCK_TABLE,)

    @classmethod
    def supports(cls, page_size: int) -> bool:
        return page_size > 1  # block-granular: compared at page 16, not at page 1

    def __init__(self, cfg: Any, max_step_tokens: int = 8192) -> None:
        super().__init__(cfg, max_step_tokens)
        P = cfg.page_size
        self.spec = FullAttentionSpec(block_size=P, num_kv_heads=1, head_size=64, dtype=torch.float16)
        self.max_blocks = -(-cfg.max_context_len // P)
        self.block_table = self.new_block_table()
        self.bt_flat = self.block_table.block_table.np.reshape(-1)  # view, like .flatten() of the CPU tensor
        self.slot_mapping = self.block_table.slot_mapping.np

    def new_block_table(self) -> Any:
        """A worker ``BlockTable`` of every lane (vLLM keeps one per KV cache group)."""
        return BlockTable(self.cfg.page_size, self.cfg.concurrency, self.max_blocks, self.max_step_tokens, False,
                          torch.device("cpu"), 1)

    def write_slot_mapping(self, req_idx: np.ndarray, pos: np.ndarray) -> int:
        """The slot of every token the step computes (its row and position), into the step's
        ``slot_mapping`` buffer; returns how many."""
        P, total = self.cfg.page_size, len(pos)
        block_numbers = self.bt_flat[req_idx * self.max_blocks + pos // P]
        np.add(block_numbers * P, pos % P, out=self.slot_mapping[:total])
        return total

    def native_bytes(self) -> int:
        # Host copies only: the ".gpu" halves of vLLM's CpuGpuBuffers live on the device in a real run.
        # The slot-mapping buffer is left out: here it must hold the trace's largest step (the whole
        # first batch's prompts), where vLLM sizes it to max_num_batched_tokens and chunks prefill;
        # the other drivers' per-step outputs are not counted either.
        return storage_bytes(self.block_table.block_table.cpu)


def ranges(starts: Any, counts: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + c)`` for each (start, count); ``starts`` may be one number."""
    if len(counts) == 0:
        return np.zeros(0, dtype=np.int64)
    total = int(counts.sum())
    offsets = np.repeat(np.cumsum(counts) - counts - starts, counts)
    return np.arange(total, dtype=np.int64) - offsets


__all__ = ["VLLM_BLOCK_TABLE", "VLLMBase", "ranges"]
