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

from typing import Any, Optional

import numpy as np
import torch

from kvpool.bench.drivers.base import Driver, storage_bytes
from kvpool.bench.trace import Step, TraceConfig

_IMPORT_ERROR: Optional[str] = None
try:
    import logging as _logging

    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.block_table import BlockTable

    _logging.getLogger("vllm").setLevel(_logging.WARNING)
except Exception as exc:  # noqa: BLE001 - any import failure means "not installed here"
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def available() -> tuple[bool, str]:
    if _IMPORT_ERROR is None:
        return True, ""
    return False, f"vllm BlockPool not importable ({_IMPORT_ERROR}); install: see docs/benchmarks.md 'Installing the baselines'"


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return ""


class VLLMBlockPoolDriver(Driver):
    name = "vllm-blockpool"
    label = "vLLM v1 BlockPool"

    @classmethod
    def supports(cls, page_size: int) -> bool:
        return page_size > 1

    def __init__(self, cfg: TraceConfig, max_step_tokens: int = 8192) -> None:
        super().__init__(cfg, max_step_tokens)
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        P = cfg.page_size
        self.pool = BlockPool(cfg.num_pages, enable_caching=False, hash_block_size=P)
        spec = FullAttentionSpec(block_size=P, num_kv_heads=1, head_size=64, dtype=torch.float16)
        self.mgr = FullAttentionManager(spec, self.pool, enable_caching=False, kv_cache_group_id=0,
                                        scheduler_block_size=P)
        self.max_blocks = -(-cfg.max_context_len // P)
        self.block_table = BlockTable(P, cfg.concurrency, self.max_blocks, max_step_tokens, False,
                                      torch.device("cpu"), 1)
        self.bt_flat = self.block_table.block_table.np.reshape(-1)  # view, like .flatten() of the CPU tensor
        self.slot_mapping = self.block_table.slot_mapping.np
        self.rids: list[str] = [""] * cfg.concurrency  # engine state: request id per lane
        self.next_id = 0

    def prepare(self, step: Step) -> Any:
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
        pos = np.concatenate([_ranges(step.admit_counts), step.decode_lens])
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
        P, total = self.cfg.page_size, len(pos)
        block_numbers = self.bt_flat[req_idx * self.max_blocks + pos // P]
        np.add(block_numbers * P, pos % P, out=self.slot_mapping[:total])
        return total

    def held_slots(self, lane: int, length: int) -> np.ndarray:
        P = self.cfg.page_size
        pos = np.arange(length, dtype=np.int64)
        return self.block_table.block_table.np[lane, pos // P].astype(np.int64) * P + pos % P

    def free_slots(self) -> int:
        return int(self.pool.get_num_free_blocks()) * self.cfg.page_size

    def native_bytes(self) -> int:
        # Host copies only: the ".gpu" halves of vLLM's CpuGpuBuffers live on the device in a real run.
        # The slot-mapping buffer is left out: here it must hold the trace's largest step (the whole
        # first batch's prompts), where vLLM sizes it to max_num_batched_tokens and chunks prefill;
        # the other drivers' per-step outputs are not counted either.
        return storage_bytes(self.block_table.block_table.cpu)

    def version(self) -> str:
        return _version()


def _ranges(counts: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(c)`` for each count (prefill positions)."""
    if len(counts) == 0:
        return np.zeros(0, dtype=np.int64)
    total = int(counts.sum())
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total, dtype=np.int64) - starts
