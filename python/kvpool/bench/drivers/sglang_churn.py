"""SGLang's real allocators, driven the way SGLang's scheduler drives them.

Imported from the installed ``sglang`` package (``sglang.srt.mem_cache.allocator``);
nothing here re-implements them. What each step does, following
``sglang/srt/mem_cache/allocation.py`` (``alloc_for_extend``,
``alloc_for_decode_default``) and the decode result processor:

- release: between ``free_group_begin()`` and ``free_group_end()``, each finished
  request's ``req_to_token`` row is handed to ``free_segment`` (what
  ``free_kv_row`` does); the group end frees them with one call.
- prefill: token allocator ``alloc(extend_num_tokens)``; paged allocator
  ``alloc_extend(prefix_lens, .., seq_lens, .., last_loc, extend_num_tokens)``
  with no cached prefix (last_loc = -1); then the rows of ``req_to_token`` are
  written request by request (the path ``write_cache_indices`` takes when the
  prefill backend has no Triton, as on CPU; without the ``.item()`` syncs).
- decode: token ``alloc(bs)``; paged ``last_loc = req_to_token[rows, seq_lens-1]``
  then ``alloc_decode(seq_lens+1, seq_lens_cpu+1, last_loc)``; then
  ``req_to_token[(rows, seq_lens)] = out_cache_loc.to(int32)``.

``req_to_token`` is the tensor ``ReqToTokenPool`` allocates ([rows+1, max_context]
int32, row 0 a padding row); the class itself is not imported because its
module pulls in torchvision. Request rows come from the trace (engine state).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool.bench.churn.result import ChurnDriver
from kvpool.bench.churn.trace import ChurnStep, ChurnTraceConfig
from kvpool.bench.drivers.sglang_base import SGLangBase


class _SGLangDriver(SGLangBase, ChurnDriver):
    def __init__(self, cfg: ChurnTraceConfig, max_step_tokens: int = 8192) -> None:
        super().__init__(cfg, max_step_tokens)
        # What ReqToTokenPool.__init__ allocates: one padding row at index 0.
        self.req_to_token = torch.zeros((cfg.concurrency + 1, cfg.max_context_len), dtype=torch.int32)

    def prepare(self, step: ChurnStep) -> Any:
        rows = step.release_lanes + 1
        release = list(zip(rows.tolist(), step.release_lens.tolist()))
        admit = list(zip((step.admit_lanes + 1).tolist(), step.admit_counts.tolist()))
        extend_num_tokens = int(step.admit_counts.sum())
        seq_lens = torch.from_numpy(step.admit_counts)
        zeros = torch.zeros_like(seq_lens)
        prefill = (zeros, zeros, seq_lens, seq_lens, torch.full_like(seq_lens, -1), extend_num_tokens)
        decode_rows = torch.from_numpy(step.decode_lanes + 1)
        decode_lens = torch.from_numpy(step.decode_lens)
        return release, admit, prefill, decode_rows, decode_lens

    def run(self, prep: Any) -> int:
        release, admit, prefill, rows, seq_lens = prep
        alloc, rtt, n = self.alloc, self.req_to_token, 0
        if release:
            alloc.free_group_begin()
            for row, length in release:
                alloc.free_segment(rtt[row, :length], start_pos=0)
            alloc.free_group_end()
        if admit:
            out = self._alloc_extend(prefill)
            if out is None:
                raise RuntimeError("SGLang allocator ran out of slots on a trace that fits the pool")
            pt = 0
            for row, count in admit:
                rtt[row, 0:count] = out[pt : pt + count]
                pt += count
            n += pt
        bs = rows.shape[0]
        if bs:
            out = self._alloc_decode(rows, seq_lens)
            if out is None:
                raise RuntimeError("SGLang allocator ran out of slots on a trace that fits the pool")
            rtt[(rows, seq_lens.clone())] = out.to(torch.int32)
            n += bs
        return n

    def _alloc_extend(self, prefill: Any) -> Any:
        raise NotImplementedError

    def _alloc_decode(self, rows: torch.Tensor, seq_lens: torch.Tensor) -> Any:
        raise NotImplementedError

    def held_slots(self, lane: int, length: int) -> np.ndarray:
        return self.req_to_token[lane + 1, :length].numpy().astype(np.int64)

    def free_slots(self) -> int:
        return int(self.alloc.available_size())


class SGLangTokenDriver(_SGLangDriver):
    name = "sglang-token"
    label = "SGLang TokenToKVPoolAllocator"

    @classmethod
    def supports(cls, page_size: int) -> bool:
        return page_size == 1

    def _alloc_extend(self, prefill: Any) -> Any:
        return self.alloc.alloc(prefill[-1])

    def _alloc_decode(self, rows: torch.Tensor, seq_lens: torch.Tensor) -> Any:
        return self.alloc.alloc(rows.shape[0])


class SGLangPagedDriver(_SGLangDriver):
    name = "sglang-paged"
    label = "SGLang PagedTokenToKVPoolAllocator"

    @classmethod
    def supports(cls, page_size: int) -> bool:
        return page_size > 1

    def _alloc_extend(self, prefill: Any) -> Any:
        prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, num_tokens = prefill
        return self.alloc.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, num_tokens)

    def _alloc_decode(self, rows: torch.Tensor, seq_lens: torch.Tensor) -> Any:
        last_loc = self.req_to_token[rows, seq_lens - 1]
        return self.alloc.alloc_decode(seq_lens + 1, seq_lens + 1, last_loc)


__all__ = ["SGLangPagedDriver", "SGLangTokenDriver"]
