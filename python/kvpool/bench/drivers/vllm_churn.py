"""vLLM v1's real BlockPool, driven the way vLLM's scheduler and model runner do.

Imported from the installed ``vllm`` package; nothing here re-implements it.
Per step, following ``vllm/v1/core`` and ``vllm/v1/worker``:

- release: ``FullAttentionManager.free(request_id)`` for each finished request
  (``BlockPool.free_blocks`` of its blocks, tail first).
- prefill and decode: per request, ``FullAttentionManager.allocate_new_blocks(
  request_id, num_tokens)`` (``BlockPool.get_new_blocks`` when the last block is
  full; the request's block list grows); the new block ids go to the worker's
  ``BlockTable`` (``add_row`` for a new request, ``append_row`` otherwise).
- slot mapping for every token scheduled in the step, from the block table and
  the token positions, on the host with numpy as vLLM's model runner computed it
  before moving it into a Triton kernel (that kernel cannot run on a CPU host).

The scheduler's admission check (``KVCacheManager.allocate_slots`` ->
``get_num_blocks_to_allocate``) is left out, which only flatters vLLM.
Prefix caching is off (``enable_caching=False``), the configuration with the
least work per block. Request ids, rows and positions come from the trace
(engine state, untimed).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.bench.churn.result import ChurnDriver
from kvpool.bench.churn.trace import ChurnStep, ChurnTraceConfig
from kvpool.bench.drivers.base import Requirement
from kvpool.bench.drivers.vllm_base import VLLMBase, ranges

VLLM_BLOCK_POOL = Requirement("vllm BlockPool")
with VLLM_BLOCK_POOL.imports():
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager


class VLLMBlockPoolDriver(VLLMBase, ChurnDriver):
    name = "vllm-blockpool"
    label = "vLLM v1 BlockPool"
    requires = (VLLM_BLOCK_POOL,)

    def __init__(self, cfg: ChurnTraceConfig, max_step_tokens: int = 8192) -> None:
        super().__init__(cfg, max_step_tokens)
        P = cfg.page_size
        self.pool = BlockPool(cfg.num_pages, enable_caching=False, hash_block_size=P)
        self.mgr = FullAttentionManager(self.spec, self.pool, enable_caching=False, kv_cache_group_id=0,
                                        scheduler_block_size=P)
        self.rids: list[str] = [""] * cfg.concurrency  # engine state: request id per lane
        self.next_id = 0

    def prepare(self, step: ChurnStep) -> Any:
        finished = [self.rids[lane] for lane in step.release_lanes.tolist()]
        admit = []
        for lane, count in zip(step.admit_lanes.tolist(), step.admit_counts.tolist()):
            rid = f"req-{self.next_id}"
            self.next_id += 1
            self.rids[lane] = rid
            admit.append((rid, lane, count))
        lanes = step.decode_lanes.tolist()
        decode = list(zip([self.rids[lane] for lane in lanes], lanes, (step.decode_lens + 1).tolist()))
        # Per scheduled token: its request's row and its position (the runner's inputs).
        req_idx = np.concatenate([np.repeat(step.admit_lanes, step.admit_counts), step.decode_lanes])
        pos = np.concatenate([ranges(0, step.admit_counts), step.decode_lens])
        return finished, admit, decode, req_idx, pos

    def run(self, prep: Any) -> int:
        finished, admit, decode, req_idx, pos = prep
        mgr, bt = self.mgr, self.block_table
        for rid in finished:
            mgr.free(rid)
        for rid, row, n in admit:
            blocks = mgr.allocate_new_blocks(rid, n, n)
            bt.add_row([b.block_id for b in blocks], row)
        for rid, row, n in decode:
            blocks = mgr.allocate_new_blocks(rid, n, n)
            if blocks:
                bt.append_row([b.block_id for b in blocks], row)
        return self.write_slot_mapping(req_idx, pos)

    def held_slots(self, lane: int, length: int) -> np.ndarray:
        P = self.cfg.page_size
        pos = np.arange(length, dtype=np.int64)
        return self.block_table.block_table.np[lane, pos // P].astype(np.int64) * P + pos % P

    def free_slots(self) -> int:
        return int(self.pool.get_num_free_blocks()) * self.cfg.page_size


__all__ = ["VLLMBlockPoolDriver"]
