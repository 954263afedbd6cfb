"""vLLM v1's KVCacheManager over its HybridKVCacheCoordinator (a full and a sliding-window group),
driven the way its scheduler drives it.

Imported from the installed ``vllm`` package; nothing here re-implements it. The same per-step
calls as the prefix driver (``vllm_prefix.py``: a ``Request`` hashed by the engine core's block
hasher, ``get_computed_blocks`` + ``allocate_slots``, decode ``allocate_slots(req, 1)`` +
``append_output_token_ids``, ``free``), on a ``KVCacheConfig`` of two groups: a
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

import numpy as np
import torch

from kvpool.bench.drivers.base import Requirement
from kvpool.bench.drivers.vllm_base import VLLMBase, ranges
from kvpool.bench.drivers.vllm_prefix import HASH_ALGO
from kvpool.bench.hybrid.trace import HybridTraceConfig
from kvpool.bench.prefix.result import PrefixDriver
from kvpool.bench.prefix.trace import PrefixStep

VLLM_HYBRID = Requirement("vllm HybridKVCacheCoordinator")
with VLLM_HYBRID.imports():
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.worker.block_table import BlockTable


class VLLMHybridDriver(VLLMBase, PrefixDriver):
    name = "vllm"
    label = "vLLM v1 KVCacheManager, HybridKVCacheCoordinator (full + sliding window)"
    requires = (VLLM_HYBRID,)

    def __init__(self, cfg: HybridTraceConfig, max_step_tokens: int = 8192) -> None:
        super().__init__(cfg, max_step_tokens)
        P = cfg.page_size
        sliding = SlidingWindowSpec(block_size=P, num_kv_heads=1, head_size=64, dtype=torch.float16,
                                    sliding_window=cfg.window)
        kv_config = KVCacheConfig(num_blocks=cfg.num_pages, kv_cache_tensors=[],
                                  kv_cache_groups=[KVCacheGroupSpec(["full.0"], self.spec),
                                                   KVCacheGroupSpec(["sliding.0"], sliding)])
        self.mgr = KVCacheManager(kv_config, max_model_len=cfg.max_context_len, scheduler_block_size=P,
                                  hash_block_size=P, enable_caching=True)
        if not isinstance(self.mgr.coordinator, HybridKVCacheCoordinator):
            raise RuntimeError(f"vLLM built {type(self.mgr.coordinator).__name__}, not its hybrid coordinator")
        hash_fn = get_hash_fn_by_name(HASH_ALGO)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(P, hash_fn)
        # The sliding group's worker table (the full group's is VLLMBase's block_table).
        self.swa_table = BlockTable(P, cfg.concurrency, self.max_blocks, max_step_tokens, False,
                                    torch.device("cpu"), 1)
        self.swa_flat = self.swa_table.block_table.np.reshape(-1)
        self.swa_slots = self.swa_table.slot_mapping.np
        self.reqs: list[Any] = [None] * cfg.concurrency
        self.seqs: list[Any] = [None] * cfg.concurrency
        self.next_id = 0
        self._evicted = 0
        pool = self.mgr.block_pool
        evict = pool._maybe_evict_cached_block

        def counting_evict(block: Any) -> bool:
            hit = evict(block)
            if hit:
                self._evicted += 1
            return hit

        pool._maybe_evict_cached_block = counting_evict  # type: ignore[method-assign]

    def prepare(self, step: PrefixStep) -> Any:
        finished = [self.reqs[lane] for lane in step.release_lanes.tolist()]
        admit = []
        for g in step.admit:
            prompt = g.prompt.tolist()
            for lane, seq in zip(g.lanes.tolist(), g.seqs):
                rid = f"req-{self.next_id}"
                self.next_id += 1
                self.seqs[lane] = seq
                admit.append((rid, lane, prompt, SamplingParams(max_tokens=seq.out_len + 1),
                              int(seq.tokens[seq.prompt_len])))
        lanes = step.decode_lanes.tolist()
        sampled = [int(self.seqs[lane].tokens[n + 1]) for lane, n in zip(lanes, step.decode_lens.tolist())]
        return finished, admit, lanes, sampled, step.decode_lens

    def run(self, prep: Any) -> int:
        finished, admit, lanes, sampled, dec_lens = prep
        mgr, full_bt, swa_bt, reqs = self.mgr, self.block_table, self.swa_table, self.reqs
        for req in finished:
            mgr.free(req)
        rows, starts, ends = [], [], []
        for rid, lane, prompt, sp, first in admit:
            req = Request(rid, prompt, sp, None, block_hasher=self.hasher)
            blocks, hit, _ = mgr.get_computed_blocks(req)
            n_new = req.num_tokens - hit
            if mgr.allocate_slots(req, n_new, hit, blocks) is None:
                raise RuntimeError("vLLM KVCacheManager ran out of blocks on a trace that fits the pool")
            req.status = RequestStatus.RUNNING
            full_ids, swa_ids = mgr.get_block_ids(rid)
            full_bt.add_row(full_ids, lane)
            swa_bt.add_row(swa_ids, lane)
            req.num_computed_tokens = req.num_tokens
            req.append_output_token_ids(first)
            reqs[lane] = req
            self.prompt_tokens += req.num_prompt_tokens
            self.computed_tokens += n_new
            rows.append(lane)
            starts.append(hit)
            ends.append(req.num_prompt_tokens)
        for lane, tok in zip(lanes, sampled):
            req = reqs[lane]
            new = mgr.allocate_slots(req, 1)
            if new is None:
                raise RuntimeError("vLLM KVCacheManager ran out of blocks on a trace that fits the pool")
            full_ids, swa_ids = new.get_block_ids()
            if full_ids:
                full_bt.append_row(full_ids, lane)
            if swa_ids:
                swa_bt.append_row(swa_ids, lane)
            req.num_computed_tokens += 1
            req.append_output_token_ids(tok)
        # Each group's slot mapping of every token this step computes (model runner, host side).
        starts_np = np.array(starts, dtype=np.int64)
        counts = np.array(ends, dtype=np.int64) - starts_np
        req_idx = np.concatenate([np.repeat(np.array(rows, dtype=np.int64), counts), np.array(lanes, dtype=np.int64)])
        pos = np.concatenate([ranges(starts_np, counts), dec_lens])
        P, total = self.cfg.page_size, len(pos)
        np.add(self.swa_flat[req_idx * self.max_blocks + pos // P] * P, pos % P, out=self.swa_slots[:total])
        return self.write_slot_mapping(req_idx, pos)

    def held_pages(self) -> int:
        pool = self.mgr.block_pool
        return (pool.num_gpu_blocks - 1) - pool.get_num_free_blocks()

    def cached_pages(self) -> int:
        return len(self.mgr.block_pool.cached_block_hash_to_block)

    def evicted_pages(self) -> int:
        return self._evicted

    def native_bytes(self) -> int:
        return super().native_bytes() + int(self.swa_table.block_table.cpu.untyped_storage().nbytes())

    def backend(self) -> str:
        return f"BlockPool shared by both groups, {HASH_ALGO} block hashes"


__all__ = ["VLLMHybridDriver"]
