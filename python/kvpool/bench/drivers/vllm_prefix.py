"""vLLM v1's KVCacheManager with prefix caching, driven the way its scheduler drives it.

Imported from the installed ``vllm`` package; nothing here re-implements it.
Per step, following ``vllm/v1/core/sched/scheduler.py`` and ``vllm/v1/engine/core.py``:

- a new sequence is a ``Request`` built with the engine core's block hasher
  (``get_request_block_hasher`` over ``prefix_caching_hash_algo``, default
  ``sha256``, after ``init_none_hash``): it hashes its full prompt blocks when
  created, as ``EngineCore.add_request`` does. That hashing is host work of
  the engine's step loop, so it is timed.
- admission: ``get_computed_blocks(request)`` (longest cached full-block prefix,
  capped at ``num_tokens - 1``), then ``allocate_slots(request, num_new_tokens,
  num_new_computed_tokens, new_computed_blocks)``, which also caches the new
  full blocks at once (so the other continuations of a parallel group admitted
  in the same step hit them, as ``n > 1`` children of a ``ParentRequest`` do).
- decode: ``allocate_slots(request, 1)``; then ``num_computed_tokens += 1``
  and ``append_output_token_ids(sampled)`` (``update_from_output``), which
  hashes each block as it fills.
- release: ``KVCacheManager.free(request)`` (blocks back tail first; hashed
  ones stay cached and evictable, LRU).
- the worker's ``BlockTable`` (``add_row`` / ``append_row``) and the slot
  mapping of every scheduled token, on the host with numpy as in the churn driver.

Evicted blocks are counted by wrapping the block pool's ``_maybe_evict_cached_block``
(one extra Python call per reused cached block).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.bench.drivers.base import Requirement, storage_bytes
from kvpool.bench.drivers.vllm_base import VLLMBase, ranges
from kvpool.bench.prefix.result import PrefixDriver
from kvpool.bench.prefix.trace import PrefixStep, PrefixTraceConfig

VLLM_KV_CACHE_MANAGER = Requirement("vllm KVCacheManager")
with VLLM_KV_CACHE_MANAGER.imports():
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request, RequestStatus

HASH_ALGO = "sha256"  # vLLM's CacheConfig.prefix_caching_hash_algo default
OUT_OF_BLOCKS = "vLLM KVCacheManager ran out of blocks on a trace that fits the pool"


class VLLMPrefixDriver(VLLMBase, PrefixDriver):
    name = "vllm"
    label = "vLLM v1 KVCacheManager (prefix caching)"
    requires = (VLLM_KV_CACHE_MANAGER,)

    def __init__(self, cfg: PrefixTraceConfig, max_step_tokens: int = 8192) -> None:
        super().__init__(cfg, max_step_tokens)
        P = cfg.page_size
        groups = self.kv_cache_groups()
        kv_config = KVCacheConfig(num_blocks=cfg.num_pages, kv_cache_tensors=[], kv_cache_groups=groups)
        self.mgr = KVCacheManager(kv_config, max_model_len=cfg.max_context_len, scheduler_block_size=P,
                                  hash_block_size=P, enable_caching=True)
        if len(groups) > 1 and not isinstance(self.mgr.coordinator, HybridKVCacheCoordinator):
            raise RuntimeError(f"vLLM built {type(self.mgr.coordinator).__name__}, not its hybrid coordinator")
        hash_fn = get_hash_fn_by_name(HASH_ALGO)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(P, hash_fn)
        # A second group's worker table, as MultiGroupBlockTable keeps one per group (the first
        # group's is VLLMBase's block_table); None with one group.
        self.second_table = self.new_block_table() if len(groups) > 1 else None
        if self.second_table is not None:
            self.second_flat = self.second_table.block_table.np.reshape(-1)
            self.second_slots = self.second_table.slot_mapping.np
        self.reqs: list[Any] = [None] * cfg.concurrency  # engine state: the Request in each lane
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

    def kv_cache_groups(self) -> list[Any]:
        """The ``KVCacheConfig``'s groups: one full-attention group."""
        return [KVCacheGroupSpec(["layer.0"], self.spec)]

    def prepare(self, step: PrefixStep) -> Any:
        finished = [self.reqs[lane] for lane in step.release_lanes.tolist()]
        admit = []
        for g in step.admit:
            prompt = g.prompt.tolist()
            for lane, seq in zip(g.lanes.tolist(), g.seqs):
                rid = f"req-{self.next_id}"
                self.next_id += 1
                self.seqs[lane] = seq
                sp = SamplingParams(max_tokens=seq.out_len + 1)
                admit.append((rid, lane, prompt, sp, int(seq.tokens[seq.prompt_len])))
        lanes = step.decode_lanes.tolist()
        sampled = [int(self.seqs[lane].tokens[n + 1]) for lane, n in zip(lanes, step.decode_lens.tolist())]
        return finished, admit, lanes, sampled, step.decode_lens

    def run(self, prep: Any) -> int:
        finished, admit, lanes, sampled, dec_lens = prep
        self._release(finished)
        rows, starts, ends = self._admit(admit)
        self._decode(lanes, sampled)
        return self._slot_mapping(rows, starts, ends, lanes, dec_lens)

    # run's phases, one call each per step (none per request): a host tier adds its calls around them.

    def _release(self, finished: list[Any]) -> None:
        mgr = self.mgr
        for req in finished:
            mgr.free(req)

    def _admit(self, admit: list[Any]) -> tuple[list[int], list[int], list[int]]:
        """Admits each new request; returns the lanes, first uncached positions and prompt ends
        of the tokens they prefill."""
        mgr, bt, second, reqs = self.mgr, self.block_table, self.second_table, self.reqs
        rows, starts, ends = [], [], []
        for rid, lane, prompt, sp, first in admit:
            req = Request(rid, prompt, sp, None, block_hasher=self.hasher)
            blocks, hit, _ = mgr.get_computed_blocks(req)
            n_new = req.num_tokens - hit
            if mgr.allocate_slots(req, n_new, hit, blocks) is None:
                raise RuntimeError(OUT_OF_BLOCKS)
            req.status = RequestStatus.RUNNING
            ids = mgr.get_block_ids(rid)
            bt.add_row(ids[0], lane)
            if second is not None:
                second.add_row(ids[1], lane)
            req.num_computed_tokens = req.num_tokens
            req.append_output_token_ids(first)
            reqs[lane] = req
            self.prompt_tokens += req.num_prompt_tokens
            self.computed_tokens += n_new
            rows.append(lane)
            starts.append(hit)
            ends.append(req.num_prompt_tokens)
        return rows, starts, ends

    def _decode(self, lanes: list[int], sampled: list[int]) -> None:
        mgr, bt, second, reqs = self.mgr, self.block_table, self.second_table, self.reqs
        for lane, tok in zip(lanes, sampled):
            req = reqs[lane]
            new = mgr.allocate_slots(req, 1)
            if new is None:
                raise RuntimeError(OUT_OF_BLOCKS)
            ids = new.get_block_ids()
            if ids[0]:
                bt.append_row(ids[0], lane)
            if second is not None and ids[1]:
                second.append_row(ids[1], lane)
            req.num_computed_tokens += 1
            req.append_output_token_ids(tok)

    def _slot_mapping(self, rows: list[int], starts: list[int], ends: list[int], lanes: list[int],
                      dec_lens: Any) -> int:
        """Slot mapping of every token this step computes, each group's (model runner, host side)."""
        starts_np = np.array(starts, dtype=np.int64)
        counts = np.array(ends, dtype=np.int64) - starts_np
        req_idx = np.concatenate([np.repeat(np.array(rows, dtype=np.int64), counts), np.array(lanes, dtype=np.int64)])
        pos = np.concatenate([ranges(starts_np, counts), dec_lens])
        if self.second_table is not None:
            P, total = self.cfg.page_size, len(pos)
            np.add(self.second_flat[req_idx * self.max_blocks + pos // P] * P, pos % P, out=self.second_slots[:total])
        return self.write_slot_mapping(req_idx, pos)

    def held_pages(self) -> int:
        pool = self.mgr.block_pool
        return (pool.num_gpu_blocks - 1) - pool.get_num_free_blocks()

    def cached_pages(self) -> int:
        return len(self.mgr.block_pool.cached_block_hash_to_block)

    def evicted_pages(self) -> int:
        return self._evicted

    def native_bytes(self) -> int:
        if self.second_table is None:
            return super().native_bytes()
        return super().native_bytes() + storage_bytes(self.second_table.block_table.cpu)

    def backend(self) -> str:
        return f"BlockPool, {HASH_ALGO} block hashes"


__all__ = ["HASH_ALGO", "OUT_OF_BLOCKS", "VLLMPrefixDriver"]
