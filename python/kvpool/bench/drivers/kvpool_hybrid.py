"""kvpool's GroupedAllocator with a full and a sliding-window group, driven as an engine drives it.

Per step, as the prefix driver (``kvpool_prefix.py``) with one call for both groups:

- release: ``close(finished, cache=True)`` (registers each sequence's full pages in both groups:
  the full group's whole prefix, the sliding group's window, under the anchor chain).
- admission, group by group: ``open_with_prefix(prompt, [len])`` (the longest prefix both groups
  serve: the full group's pages for [0, L) and the sliding group's window before L);
  ``fill_table`` of both groups' request-to-token rows for the hit; ``extend`` by the rest of the
  prompt with both tables; ``cache``; for n > 1 ``fork`` and ``fill_table`` of the children.
- decode: one ``extend(handles, 1, tokens=fed, tables=)`` for the batch (the sliding group lets go
  of the page the window passed and writes the null page's slots there), then ``take_copies``
  of both groups.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import kvpool
from kvpool.bench.hybrid.trace import HybridTraceConfig
from kvpool.bench.prefix.result import PrefixDriver
from kvpool.bench.prefix.trace import PrefixStep
from kvpool.layout import padded_table

EVENT_REMOVED = 1  # take_events()["kind"]: 0 Stored, 1 Removed, 2 Cleared
FULL, SLIDING = 0, 1


class KVPoolHybridDriver(PrefixDriver):
    name = "kvpool"
    label = "kvpool GroupedAllocator (full + sliding window)"

    def __init__(self, cfg: HybridTraceConfig, max_step_tokens: int = 8192) -> None:
        super().__init__(cfg, max_step_tokens)
        P = cfg.page_size
        self.alloc = kvpool.GroupedAllocator(
            [{"kind": "full", "num_pages": cfg.full_pages, "page_size": P},
             {"kind": "sliding", "num_pages": cfg.sliding_pages, "page_size": P, "window": cfg.window}],
            cfg.concurrency, cfg.max_context_len)
        # Each group's CPU req_to_token (KVPool mirrors them to the device), touched here so that
        # first-write page faults are not timed.
        self.tables = [padded_table(cfg.concurrency, cfg.max_context_len) for _ in range(2)]
        for t in self.tables:
            t.fill(0)
        self.handles = np.zeros(cfg.concurrency, dtype=np.int64)
        self._evicted = 0

    def prepare(self, step: PrefixStep) -> Any:
        self._count_events()  # untimed: drain the event queue the timed calls filled
        groups = [(g.prompt, np.array([len(g.prompt)], dtype=np.int64), g.lanes, g.n) for g in step.admit]
        return self.handles[step.release_lanes], groups, self.handles[step.decode_lanes], step.decode_tokens

    def run(self, prep: Any) -> int:
        finished, groups, decoding, fed = prep
        a, tables, n = self.alloc, self.tables, 0
        if len(finished):
            a.close(finished, cache=True)
        for prompt, length, lanes, k in groups:
            h, cached = a.open_with_prefix(prompt, length)
            h0, hit, total = int(h[0]), int(cached[0]), int(length[0])
            if hit:
                a.fill_table(h, tables[FULL], FULL)
                a.fill_table(h, tables[SLIDING], SLIDING)
            n += len(a.extend(h, total - hit, tables=tables)[FULL])
            a.cache(h)
            self.prompt_tokens += k * total
            self.computed_tokens += total - hit
            self.handles[lanes[0]] = h0
            if k > 1:
                children = a.fork(h0, k - 1)
                a.fill_table(children, tables[FULL], FULL)
                a.fill_table(children, tables[SLIDING], SLIDING)
                self.handles[lanes[1:]] = children
        if len(decoding):
            n += len(a.extend(decoding, 1, tokens=fed, tables=tables)[FULL])
        a.take_copies(FULL)
        a.take_copies(SLIDING)
        return n

    def _count_events(self) -> None:
        kinds = self.alloc.take_events()["kind"]
        self._evicted += int(np.count_nonzero(kinds == EVENT_REMOVED))

    def held_pages(self) -> int:
        return int(self.alloc.used_pages(FULL) + self.alloc.used_pages(SLIDING))

    def cached_pages(self) -> int:
        return int(self.alloc.evictable_pages(FULL) + self.alloc.evictable_pages(SLIDING))

    def evicted_pages(self) -> int:
        # The anchor chain's (the full group's) Removed events; the sliding group publishes none.
        self._count_events()
        return self._evicted

    def native_bytes(self) -> int:
        return int(self.alloc.metadata_bytes)

    def backend(self) -> str:
        return "Rust core, two groups, hashed full pages"


__all__ = ["KVPoolHybridDriver"]
