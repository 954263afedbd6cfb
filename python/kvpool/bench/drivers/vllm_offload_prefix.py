"""vLLM v1's KVCacheManager with its CPU offloading tier (``CPUOffloadingManager``), LRU or ARC.

Imported from the installed ``vllm`` package; nothing here re-implements it. The device
side is ``VLLMPrefixDriver`` unchanged; the host side is driven with the calls its
``OffloadingConnectorScheduler`` (``distributed/kv_transfer/kv_connector/v1/offloading/
scheduler.py``) makes, for one KV cache group whose offloaded block is one device block:

- a new request: ``on_new_request(ReqContext)``; after the device prefix hit
  (``get_computed_blocks``), ``lookup`` of each following full prompt block's key
  (``make_offload_key(block_hash, 0)``) up to the first miss, capped at
  ``num_tokens - 1`` as the device hit is (``get_num_new_matched_tokens``); the hit
  blocks count as external computed tokens in ``allocate_slots``, and
  ``prepare_load`` hands out their host chunks (``update_state_after_alloc``).
- every block that becomes full on the device (the prompt's after its prefill, each
  decode block as it fills) is offered with ``prepare_store`` (``build_connector_meta``):
  vLLM writes through, every computed block, evicting host chunks by the policy.
- the worker's transfers complete before the next step (``complete_load`` /
  ``complete_store``, from ``update_connector_output``); the loads are treated as
  synchronous, as kvpool's are (the request runs in the step it was admitted).
- a finished request: ``on_request_finished`` (``request_finished``), then ``free``.

Same device pages as every driver, and ``cfg.host_pages - 1`` host chunks: the host
pages kvpool's host tier can use (its page 0 is reserved).
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvpool.bench.drivers.base import Requirement
from kvpool.bench.drivers.vllm_prefix import OUT_OF_BLOCKS, VLLMPrefixDriver
from kvpool.bench.prefix.result import HostTierDriver
from kvpool.bench.prefix.trace import PrefixTraceConfig

VLLM_CPU_OFFLOADING = Requirement("vllm CPUOffloadingManager")
with VLLM_CPU_OFFLOADING.imports():
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    from vllm.v1.request import Request, RequestStatus


class VLLMOffloadLRUDriver(HostTierDriver, VLLMPrefixDriver):
    name = "vllm-offload-lru"
    label = "vLLM v1 KVCacheManager + CPUOffloadingManager (LRU)"
    requires = VLLMPrefixDriver.requires + (VLLM_CPU_OFFLOADING,)
    policy: ClassVar[str] = "lru"
    tier = "BlockPool + CPUOffloadingManager"

    def __init__(self, cfg: PrefixTraceConfig, max_step_tokens: int = 8192) -> None:
        super().__init__(cfg, max_step_tokens)
        self.cpu = CPUOffloadingManager(num_chunks=self.host_pages(), cache_policy=self.policy)
        self.ctx: list[Any] = [None] * cfg.concurrency
        self.offered = [0] * cfg.concurrency  # full blocks of the lane's request offered to the host
        self.jobs: list[tuple[bool, list[Any], Any]] = []  # (is_store, keys, ctx) finishing next step
        self._lane: dict[str, int] = {}  # request id -> lane

    def _store_new_blocks(self, lane: int, req: Any) -> None:
        full = req.num_computed_tokens // self.cfg.page_size
        if full <= self.offered[lane]:
            return
        keys = [make_offload_key(h, 0) for h in req.block_hashes[self.offered[lane]:full]]
        self.offered[lane] = full
        out = self.cpu.prepare_store(keys, self.ctx[lane])
        if out is not None and out.keys_to_store:
            self.offloaded_pages += len(out.keys_to_store)
            self.jobs.append((True, list(out.keys_to_store), self.ctx[lane]))

    # The host manager's calls touch none of the device manager's state, so they run before or
    # after the device phases they belong to, in the same request order.

    def _release(self, finished: list[Any]) -> None:
        cpu = self.cpu
        for store, keys, ctx in self.jobs:  # the worker finished the previous step's transfers
            (cpu.complete_store if store else cpu.complete_load)(keys, ctx)
        self.jobs = []
        for req in finished:
            cpu.on_request_finished(self.ctx[self._lane[req.request_id]])
        super()._release(finished)

    def _admit(self, admit: list[Any]) -> tuple[list[int], list[int], list[int]]:
        mgr, cpu, bt, reqs, P = self.mgr, self.cpu, self.block_table, self.reqs, self.cfg.page_size
        rows, starts, ends = [], [], []
        for rid, lane, prompt, sp, first in admit:
            req = Request(rid, prompt, sp, None, block_hasher=self.hasher)
            ctx = ReqContext(rid)
            cpu.on_new_request(ctx)
            blocks, hit, _ = mgr.get_computed_blocks(req)
            keys = []
            for i in range(hit // P, (req.num_tokens - 1) // P):
                key = make_offload_key(req.block_hashes[i], 0)
                if cpu.lookup(key, ctx) != LookupResult.HIT:
                    break
                keys.append(key)
            ext = len(keys) * P
            n_new = req.num_tokens - hit - ext
            if mgr.allocate_slots(req, n_new, hit, blocks, num_external_computed_tokens=ext) is None:
                raise RuntimeError(OUT_OF_BLOCKS)
            if keys:
                cpu.prepare_load(keys, ctx)
                self.loaded_pages += len(keys)
                self.jobs.append((False, keys, ctx))
            req.status = RequestStatus.RUNNING
            bt.add_row(mgr.get_block_ids(rid)[0], lane)
            req.num_computed_tokens = req.num_tokens
            req.append_output_token_ids(first)
            reqs[lane], self.ctx[lane], self.offered[lane] = req, ctx, 0
            self._lane[rid] = lane
            self._store_new_blocks(lane, req)
            self.prompt_tokens += req.num_prompt_tokens
            self.computed_tokens += n_new
            rows.append(lane)
            starts.append(hit + ext)
            ends.append(req.num_prompt_tokens)
        return rows, starts, ends

    def _decode(self, lanes: list[int], sampled: list[int]) -> None:
        super()._decode(lanes, sampled)
        reqs = self.reqs
        for lane in lanes:  # each decode block that filled goes to the host (prepare_store)
            self._store_new_blocks(lane, reqs[lane])


class VLLMOffloadARCDriver(VLLMOffloadLRUDriver):
    name = "vllm-offload-arc"
    label = "vLLM v1 KVCacheManager + CPUOffloadingManager (ARC)"
    policy = "arc"


__all__ = ["VLLMOffloadARCDriver", "VLLMOffloadLRUDriver"]
