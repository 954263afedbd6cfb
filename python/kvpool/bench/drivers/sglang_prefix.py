"""SGLang's RadixCache over its real allocators, driven the way SGLang's scheduler drives it.

Imported from the installed ``sglang`` package; nothing here re-implements it.
The tree, the allocators, ``ReqToTokenPool`` and the allocation helpers are
SGLang's own; the request record handed to them (``RequestRecord``) carries only the
fields those calls read (SGLang's ``Req`` needs a running scheduler). Per step,
following ``managers/schedule_policy.py``, ``mem_cache/allocation.py``,
``mem_cache/common.py`` and the batch result processor:

- release (``release_kv_cache(checkpoint=True)``), inside ``free_group_begin/end``:
  ``tree.checkpoint(req, up_to=len)`` (insert the whole sequence, free the
  duplicates, repoint the row to the tree's copy, move the lock), then
  ``tree.free_kv_row(req.kv, [(cache_protected_len, len)])`` and ``tree.unlock(req.lock)``.
- admission: ``match_prefix`` with the key capped at ``len - 1``
  (``Req._compute_max_prefix_len``), ``tree.lock(last_node)``; one
  allocation for the batch, ``alloc_token_slots`` / ``alloc_paged_token_slots_extend``
  (they evict from the tree when the allocator runs short, then ``alloc`` /
  ``alloc_extend``); the rows of ``req_to_token`` get the prefix indices
  (``prefix_device_indices``) and the new slots (``write_cache_indices``'s CPU path).
  After the prefill, inside one free group as ``process_batch_result_prefill`` does,
  ``checkpoint_kv_cache`` inserts each prompt (``cache_unfinished_req``) and the requests
  the prefill finished are released.
- parallel sampling (n > 1): SGLang's tokenizer manager first sends the prompt
  with ``max_new_tokens=0`` to cache it, then the n samples, which match it;
  both batches run within the step here.
- decode: ``alloc_token_slots`` / ``alloc_paged_token_slots_decode`` (evicting
  when short), then ``req_to_token[(rows, seq_lens)] = out_cache_loc``.

Which tree runs: ``SGLangPrefixDriver`` drives ``RadixCache``, a Python tree.
``SGLangUnifiedPrefixDriver`` makes the same calls on ``UnifiedRadixCache`` (the
cache SGLang's scheduler builds by default), whose TreeCore is Rust
(``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=rust``, the default) only where its
extension loads (torch 2.11-2.14) and Python otherwise; each row reports the
TreeCore it got, and ``tree_core_backend()`` what the selection resolves to here.
"""

from __future__ import annotations

import os
from array import array
from typing import Any

import torch

from kvpool.bench.drivers.base import Requirement
from kvpool.bench.drivers.sglang_base import SGLangBase
from kvpool.bench.drivers.sglang_records import RequestRecord
from kvpool.bench.prefix.result import PrefixDriver
from kvpool.bench.prefix.trace import PrefixStep, PrefixTraceConfig

SGLANG_RADIX = Requirement("sglang RadixCache")
with SGLANG_RADIX.imports():
    from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_decode, alloc_paged_token_slots_extend, alloc_token_slots  # type: ignore[import-untyped,unused-ignore]
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams  # type: ignore[import-untyped,unused-ignore]
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # type: ignore[import-untyped,unused-ignore]
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # type: ignore[import-untyped,unused-ignore]
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # type: ignore[import-untyped,unused-ignore]


def tree_core_backend(page_size: int = 1) -> str:
    """The TreeCore SGLang's default ``UnifiedRadixCache`` resolves to in this environment, and why."""
    try:
        import logging

        from sglang.srt.mem_cache.unified_cache.tree_core_registry import _rust_fallback_reason, select_tree_core_backend  # type: ignore[import-untyped,unused-ignore]

        params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                                 page_size=page_size)
        logging.getLogger("sglang.srt.mem_cache.unified_cache.tree_core_registry").setLevel(logging.WARNING)
        name = select_tree_core_backend(params)
        # A fallback has a reason; a Python tree asked for by name has none (SGLang's
        # reason function reports the torch range whatever was asked for).
        asked = os.environ.get("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "rust").strip().lower()
        why = _rust_fallback_reason(params) if name != "rust" and asked != "python" else None
        return f"{name}" + (f" ({why})" if why else "")
    except Exception as exc:  # noqa: BLE001
        return f"unknown ({type(exc).__name__}: {exc})"


class SGLangPrefixDriver(SGLangBase, PrefixDriver):
    name = "sglang"
    label = "SGLang RadixCache + TokenToKVPoolAllocator"
    requires = (SGLANG_RADIX,)

    def __init__(self, cfg: PrefixTraceConfig, max_step_tokens: int = 8192) -> None:
        super().__init__(cfg, max_step_tokens)
        # Rows 1..C are the lanes; row C+1 serves the n > 1 warm-up requests.
        self.pool = ReqToTokenPool(cfg.concurrency + 1, cfg.max_context_len, "cpu", False)
        self.req_to_token = self.pool.req_to_token
        self.warm_row = cfg.concurrency + 1
        self.tree = self._make_tree(CacheInitParams(disable=False, req_to_token_pool=self.pool,
                                                    token_to_kv_pool_allocator=self.alloc, page_size=cfg.page_size))
        self.reqs: list[Any] = [None] * cfg.concurrency
        self._evicted_tokens = 0
        # Count what eviction frees: wrap the method every eviction path of this cache goes through.
        name = self._evict_method
        evict = getattr(self.tree, name)

        def counting_evict(*args: Any, **kwargs: Any) -> Any:
            result = evict(*args, **kwargs)
            self._evicted_tokens += result.num_tokens_evicted
            return result

        setattr(self.tree, name, counting_evict)

    _evict_method = "evict"  # RadixCache: evict_for_alloc and evict_to_free_tokens end in evict

    def _make_tree(self, params: Any) -> Any:
        return RadixCache(params)

    def prepare(self, step: PrefixStep) -> Any:
        release = [self.reqs[lane] for lane in step.release_lanes.tolist()]
        batch: list[tuple[RequestRecord, int]] = []  # (request, lane; -1 for an n > 1 warm-up)
        samples: list[tuple[RequestRecord, int]] = []
        for g in step.admit:
            prompt = array("q", g.prompt.tolist())
            if g.n > 1:
                batch.append((RequestRecord(self.warm_row, prompt, prompt), -1))
            for lane, seq in zip(g.lanes.tolist(), g.seqs):
                req = RequestRecord(lane + 1, prompt, array("q", seq.tokens.tolist()))
                (samples if g.n > 1 else batch).append((req, lane))
        rows = torch.from_numpy(step.decode_lanes + 1)
        seq_lens = torch.from_numpy(step.decode_lens)
        return release, batch, samples, rows, seq_lens, step.decode_lanes.tolist()

    def run(self, prep: Any) -> int:
        release, batch, samples, rows, seq_lens, dec_lanes = prep
        alloc, n = self.alloc, 0
        if release:
            alloc.free_group_begin()
            for req in release:
                self._release(req, req.seq_len)
            alloc.free_group_end()
        if batch:
            n += self._prefill(batch)
            self._prefill_result(batch)
        if samples:
            n += self._prefill(samples)
            self._prefill_result(samples)
        bs = rows.shape[0]
        if bs:
            n += self._decode(rows, seq_lens)
            reqs = self.reqs
            for lane in dec_lanes:
                reqs[lane].seq_len += 1
        return n

    def _release(self, req: Any, length: int) -> None:
        tree = self.tree
        req.done = True  # release_kv_cache(checkpoint=True) runs on a finished request
        tree.checkpoint(req, up_to=length)
        tree.free_kv_row(req.kv, [(req.kv.cache_protected_len, length)])
        tree.unlock(req.lock)
        req.lock = None

    def _prefill(self, batch: list) -> int:
        tree, P = self.tree, self.cfg.page_size
        prefixes = []
        for req, _ in batch:
            ids = req.origin_input_ids
            m = tree.match_prefix(MatchPrefixParams(key=RadixKey(ids, None, limit=len(ids) - 1)))
            req.prefix_len = req.kv.cache_protected_len = m.device_prefix_len
            req.last_node = m.last_device_node
            req.lock = tree.lock(req.last_node)
            prefixes.append(tree.prefix_device_indices(req) if req.prefix_len else None)
        prefix_lens = [req.prefix_len for req, _ in batch]
        seq_lens = [len(req.origin_input_ids) for req, _ in batch]
        extend = sum(seq_lens) - sum(prefix_lens)
        if P == 1:
            out = alloc_token_slots(tree, extend)
        else:
            pl = torch.tensor(prefix_lens, dtype=torch.int64)
            sl = torch.tensor(seq_lens, dtype=torch.int64)
            last = torch.cat([p[-1:] if p is not None else torch.full((1,), -1, dtype=torch.int64) for p in prefixes])
            out = alloc_paged_token_slots_extend(tree, pl, pl, sl, sl, last, extend)
        rtt, pt = self.req_to_token, 0
        for (req, lane), prefix, plen, slen in zip(batch, prefixes, prefix_lens, seq_lens):
            row = req.kv.req_pool_idx
            if prefix is not None:
                rtt[row, :plen] = prefix
            rtt[row, plen:slen] = out[pt : pt + slen - plen]
            pt += slen - plen
            self.computed_tokens += slen - plen
            if lane >= 0:
                self.prompt_tokens += slen
                self.reqs[lane] = req
        return pt

    def _prefill_result(self, batch: list) -> None:
        """``process_batch_result_prefill``: inside one free group, release the requests their
        prefill finished (the n > 1 warm-ups, ``max_new_tokens=0``) and checkpoint the others
        (``cache_unfinished_req``). The group matters: outside one, every free of the page-1
        allocator (``need_sort=False``) concatenates its whole free list."""
        tree, alloc = self.tree, self.alloc
        alloc.free_group_begin()
        for req, lane in batch:
            if lane < 0:
                self._release(req, req.seq_len)
            else:
                tree.checkpoint(req, up_to=req.seq_len)
        alloc.free_group_end()

    def _decode(self, rows: torch.Tensor, seq_lens: torch.Tensor) -> int:
        bs = rows.shape[0]
        if self.cfg.page_size == 1:
            out = alloc_token_slots(self.tree, bs)
        else:
            last_loc = self.req_to_token[rows, seq_lens - 1]
            out = alloc_paged_token_slots_decode(self.tree, seq_lens + 1, seq_lens + 1, last_loc)
        self.pool.write((rows, seq_lens.clone()), out.to(torch.int32))
        return bs

    def held_pages(self) -> int:
        P = self.cfg.page_size
        usable = (self.cfg.num_pages - 1) * P
        return (usable - int(self.alloc.available_size()) - int(self.tree.evictable_size())) // P

    def cached_pages(self) -> int:
        return int(self.tree.evictable_size() + self.tree.protected_size()) // self.cfg.page_size

    def evicted_pages(self) -> int:
        return self._evicted_tokens // self.cfg.page_size

    def backend(self) -> str:
        return "RadixCache (Python tree)"


class SGLangUnifiedPrefixDriver(SGLangPrefixDriver):
    """The same scheduler calls on ``UnifiedRadixCache`` (full-attention component only), the
    cache SGLang's scheduler builds by default; its TreeCore is Rust where that extension loads."""

    name = "sglang-unified"
    label = "SGLang UnifiedRadixCache + TokenToKVPoolAllocator"
    _evict_method = "_evict"  # its evict and evict_for_alloc both end in _evict

    def _make_tree(self, params: Any) -> Any:
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # type: ignore[import-untyped,unused-ignore]
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # type: ignore[import-untyped,unused-ignore]

        params.tree_components = (ComponentType.FULL,)
        return UnifiedRadixCache(params)

    def backend(self) -> str:
        # The TreeCore actually built (RustUnifiedTreeCore / UnifiedTreeCore), not only the name
        # the selection resolved to, so a row proves which tree it timed.
        core = type(self.tree.tree_core)
        kind = "rust" if core.__module__.startswith("sglang.srt.mem_cache.rust_tree_core") else "python"
        return f"UnifiedRadixCache, {kind} TreeCore ({core.__name__})"


__all__ = ["SGLANG_RADIX", "SGLangPrefixDriver", "SGLangUnifiedPrefixDriver", "tree_core_backend"]
