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

import kvpool
from kvpool.bench.drivers.kvpool_prefix import KVPoolPrefixDriver

FULL, SLIDING = 0, 1


class KVPoolHybridDriver(KVPoolPrefixDriver):
    # evicted_pages counts the anchor chain's (the full group's) Removed events; the sliding
    # group publishes none.
    label = "kvpool GroupedAllocator (full + sliding window)"
    groups = 2

    def new_allocator(self) -> Any:
        cfg, P = self.cfg, self.cfg.page_size
        return kvpool.GroupedAllocator(
            [{"kind": "full", "num_pages": cfg.full_pages, "page_size": P},
             {"kind": "sliding", "num_pages": cfg.sliding_pages, "page_size": P, "window": cfg.window}],
            cfg.concurrency, cfg.max_context_len)

    def run(self, prep: Any) -> int:
        finished, groups, decoding, fed = prep
        a, tables, n = self.alloc, self.tables, 0
        full, sliding = tables
        if len(finished):
            a.close(finished, cache=True)
        for prompt, length, lanes, k in groups:
            h, cached = a.open_with_prefix(prompt, length)
            h0, hit, total = int(h[0]), int(cached[0]), int(length[0])
            if hit:
                a.fill_table(h, full, FULL)
                a.fill_table(h, sliding, SLIDING)
            n += len(a.extend(h, total - hit, tables=tables)[FULL])
            a.cache(h)
            self.prompt_tokens += k * total
            self.computed_tokens += total - hit
            self.handles[lanes[0]] = h0
            if k > 1:
                children = a.fork(h0, k - 1)
                a.fill_table(children, full, FULL)
                a.fill_table(children, sliding, SLIDING)
                self.handles[lanes[1:]] = children
        if len(decoding):
            n += len(a.extend(decoding, 1, tokens=fed, tables=tables)[FULL])
        a.take_copies(FULL)
        a.take_copies(SLIDING)
        return n

    def held_pages(self) -> int:
        return int(self.alloc.used_pages(FULL) + self.alloc.used_pages(SLIDING))

    def cached_pages(self) -> int:
        return int(self.alloc.evictable_pages(FULL) + self.alloc.evictable_pages(SLIDING))

    def backend(self) -> str:
        return "Rust core, two groups, hashed full pages"


__all__ = ["KVPoolHybridDriver"]
