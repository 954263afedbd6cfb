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

from typing import Any, Optional

import numpy as np
import torch

from kvpool.bench.prefix_drivers.base import PrefixDriver, dist_version
from kvpool.bench.prefix_trace import PrefixStep, PrefixTraceConfig

_IMPORT_ERROR: Optional[str] = None
try:
    import logging as _logging

    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.worker.block_table import BlockTable

    _logging.getLogger("vllm").setLevel(_logging.WARNING)
except Exception as exc:  # noqa: BLE001 - any import failure means "not installed here"
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

HASH_ALGO = "sha256"  # vLLM's CacheConfig.prefix_caching_hash_algo default


def available() -> tuple[bool, str]:
    if _IMPORT_ERROR is None:
        return True, ""
    return False, f"vllm KVCacheManager not importable ({_IMPORT_ERROR}); install: see README 'Benchmarks'"


class VLLMPrefixDriver(PrefixDriver):
    name = "vllm"
    label = "vLLM v1 KVCacheManager (prefix caching)"

    @classmethod
    def supports(cls, page_size: int) -> bool:
        return page_size > 1

    def __init__(self, cfg: PrefixTraceConfig, max_step_tokens: int = 8192) -> None:
        super().__init__(cfg, max_step_tokens)
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        P = cfg.page_size
        spec = FullAttentionSpec(block_size=P, num_kv_heads=1, head_size=64, dtype=torch.float16)
        kv_config = KVCacheConfig(num_blocks=cfg.num_pages, kv_cache_tensors=[],
                                  kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        self.mgr = KVCacheManager(kv_config, max_model_len=cfg.max_context_len, scheduler_block_size=P,
                                  hash_block_size=P, enable_caching=True)
        hash_fn = get_hash_fn_by_name(HASH_ALGO)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(P, hash_fn)
        self.max_blocks = -(-cfg.max_context_len // P)
        self.block_table = BlockTable(P, cfg.concurrency, self.max_blocks, max_step_tokens, False,
                                      torch.device("cpu"), 1)
        self.bt_flat = self.block_table.block_table.np.reshape(-1)
        self.slot_mapping = self.block_table.slot_mapping.np
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
        mgr, bt, reqs = self.mgr, self.block_table, self.reqs
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
            bt.add_row(mgr.get_block_ids(rid)[0], lane)
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
            ids = new.get_block_ids()[0]
            if ids:
                bt.append_row(ids, lane)
            req.num_computed_tokens += 1
            req.append_output_token_ids(tok)
        # Slot mapping of every token this step computes (model runner, host side).
        starts_np = np.array(starts, dtype=np.int64)
        counts = np.array(ends, dtype=np.int64) - starts_np
        req_idx = np.concatenate([np.repeat(np.array(rows, dtype=np.int64), counts), np.array(lanes, dtype=np.int64)])
        pos = np.concatenate([_ranges(starts_np, counts), dec_lens])
        P, total = self.cfg.page_size, len(pos)
        block_numbers = self.bt_flat[req_idx * self.max_blocks + pos // P]
        np.add(block_numbers * P, pos % P, out=self.slot_mapping[:total])
        return total

    def held_pages(self) -> int:
        pool = self.mgr.block_pool
        return (pool.num_gpu_blocks - 1) - pool.get_num_free_blocks()

    def cached_pages(self) -> int:
        return len(self.mgr.block_pool.cached_block_hash_to_block)

    def evicted_pages(self) -> int:
        return self._evicted

    def native_bytes(self) -> int:
        return int(self.block_table.block_table.cpu.untyped_storage().nbytes())

    def backend(self) -> str:
        return f"BlockPool, {HASH_ALGO} block hashes"

    def version(self) -> str:
        return dist_version("vllm")


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + c)`` for each (start, count)."""
    if len(counts) == 0:
        return np.zeros(0, dtype=np.int64)
    total = int(counts.sum())
    offsets = np.repeat(np.cumsum(counts) - counts - starts, counts)
    return np.arange(total, dtype=np.int64) - offsets
