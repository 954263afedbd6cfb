"""kvpool's SlotAllocator with its prefix cache, driven the way kvpool.KVPool drives it on the host.

Per step:
- release: ``close(finished, cache=True)``: every full page whose tokens are known
  (prompt and fed output tokens) is registered, then released (HELD -> CACHED).
- admission, group by group (as vLLM's scheduler admits request by request, so a
  later request in the same step hits the pages an earlier one registered):
  ``open_with_prefix(prompt, [len], table=)`` (longest registered full-page
  prefix, capped at ``len - 1``; its slots go straight into the engine's CPU
  ``req_to_token``), ``extend`` by the rest of the prompt with ``table=``,
  ``cache`` (its full pages become hittable as soon as they are scheduled, like
  vLLM's ``allocate_slots``), and for n > 1 ``fork(handle, n - 1, table=)``:
  the continuations share every page (and get the parent's table row), the
  partial last one copy-on-write.
- decode: one ``extend(handles, 1, tokens=fed, table=)`` for the batch, then
  ``take_copies()`` (the copy-on-write copies KVPool runs on the device before
  the step's writes).
Eviction happens inside ``extend`` when no FREE page is left (LRU, tail first).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import kvpool
from kvpool.bench.drivers.kvpool_base import KVPoolBase
from kvpool.bench.prefix.result import HostTierDriver, PrefixDriver
from kvpool.bench.prefix.trace import PrefixStep, PrefixTraceConfig

EVENT_REMOVED = 1  # take_events()["kind"]: 0 Stored, 1 Removed, 2 Cleared


class KVPoolPrefixDriver(KVPoolBase, PrefixDriver):
    label = "kvpool SlotAllocator (prefix cache)"

    @classmethod
    def skip_reason(cls) -> str | None:
        # An installed kvpool may predate shared pages; say so instead of failing mid-run.
        missing = [m for m in ("open_with_prefix", "fork", "cache", "take_copies") if not hasattr(kvpool.SlotAllocator, m)]
        if missing:
            return f"this kvpool build has no shared pages yet (missing SlotAllocator.{', .'.join(missing)})"
        return None

    def __init__(self, cfg: PrefixTraceConfig, max_step_tokens: int = 8192) -> None:
        super().__init__(cfg, max_step_tokens)
        self._evicted = 0
        self._copies = 0

    def new_allocator(self) -> Any:
        cfg = self.cfg
        return kvpool.SlotAllocator(cfg.num_pages, cfg.page_size, cfg.concurrency, cfg.max_context_len,
                                    kv_events=cfg.kv_events)

    def prepare(self, step: PrefixStep) -> Any:
        self._count_events()  # untimed: drain the event queue the timed calls filled
        groups = [(g.prompt, np.array([len(g.prompt)], dtype=np.int64), g.lanes, g.n) for g in step.admit]
        return self.handles[step.release_lanes], groups, self.handles[step.decode_lanes], step.decode_tokens

    def run(self, prep: Any) -> int:
        finished, groups, decoding, fed = prep
        a, table, n = self.alloc, self.table, 0
        if len(finished):
            a.close(finished, cache=True)
        for prompt, length, lanes, k in groups:
            h, cached = a.open_with_prefix(prompt, length, table=table)
            h0, hit, total = int(h[0]), int(cached[0]), int(length[0])
            n += len(a.extend(h, total - hit, table=table))
            a.cache(h)
            self.prompt_tokens += k * total
            self.computed_tokens += total - hit
            self.handles[lanes[0]] = h0
            if k > 1:
                self.handles[lanes[1:]] = a.fork(h0, k - 1, table=table)
        if len(decoding):
            n += len(a.extend(decoding, 1, tokens=fed, table=table))
            src, _ = a.take_copies()
            self._copies += len(src)
        return n

    def _count_events(self) -> None:
        if not self.cfg.kv_events:
            return
        kinds = self.alloc.take_events()["kind"]
        self._evicted += int(np.count_nonzero(kinds == EVENT_REMOVED))

    def held_pages(self) -> int:
        return int(self.alloc.used_pages)

    def cached_pages(self) -> int:
        return int(self.alloc.cached_pages)

    def evicted_pages(self) -> int:
        if not self.cfg.kv_events:
            return -1  # only the Removed events count them
        self._count_events()
        return self._evicted

    def backend(self) -> str:
        if not self.cfg.kv_events:
            return "Rust core, hashed full pages (no KV events: internal chain keys)"
        return "Rust core, hashed full pages"


class KVPoolHostPrefixDriver(HostTierDriver, KVPoolPrefixDriver):
    """The same calls on a SlotAllocator with a host tier (``cfg.host_pages``, write_back),
    plus what ``KVPool`` does after each call that can queue a transfer: ``take_offloads()``
    and ``take_loads()`` (the page ids it hands to the transfer runner; the bytes move on
    the device, not here)."""

    name = "kvpool-host"
    label = "kvpool SlotAllocator with a host tier (write_back)"
    policy = "write_back"
    tier = "Rust core, host tier"

    def new_allocator(self) -> Any:
        cfg = self.cfg
        return kvpool.SlotAllocator(cfg.num_pages, cfg.page_size, cfg.concurrency, cfg.max_context_len,
                                    host_pages=cfg.host_pages, host_policy=self.policy, kv_events=cfg.kv_events)

    def _take(self) -> None:
        a = self.alloc
        self.offloaded_pages += len(a.take_offloads()[0])
        self.loaded_pages += len(a.take_loads()[0])

    def run(self, prep: Any) -> int:
        finished, groups, decoding, fed = prep
        a, table, n = self.alloc, self.table, 0
        if len(finished):
            a.close(finished, cache=True)
            self._take()
        for prompt, length, lanes, k in groups:
            h, cached = a.open_with_prefix(prompt, length, table=table)
            self._take()
            h0, hit, total = int(h[0]), int(cached[0]), int(length[0])
            self.prompt_tokens += k * total
            self.computed_tokens += total - hit
            n += len(a.extend(h, total - hit, table=table))
            self._take()
            a.cache(h)
            self._take()
            self.handles[lanes[0]] = h0
            if k > 1:
                self.handles[lanes[1:]] = a.fork(h0, k - 1, table=table)
        if len(decoding):
            n += len(a.extend(decoding, 1, tokens=fed, table=table))
            self._take()
            src, _ = a.take_copies()
            self._copies += len(src)
        return n


class KVPoolWriteThroughPrefixDriver(KVPoolHostPrefixDriver):
    name = "kvpool-host-wt"
    label = "kvpool SlotAllocator with a host tier (write_through)"
    policy = "write_through"


__all__ = ["KVPoolHostPrefixDriver", "KVPoolPrefixDriver", "KVPoolWriteThroughPrefixDriver"]
