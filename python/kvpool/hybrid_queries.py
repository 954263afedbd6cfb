"""Queries of a hybrid ``KVPool`` (``kvpool.hybrid``): lengths, slots, pages, page tables and
counters, each one call into the core's ``GroupedAllocator`` for the layer's group. Nothing here
changes ownership, so nothing takes the pool's lock (the core's calls are atomic)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.lifecycle import read_consistent
from kvpool.streams import refuse_capture
from kvpool.tables import PageTable, page_table_tensors

__all__ = ["HybridQueries"]


class HybridQueries:
    """Mixin: ``HybridKVPool``'s queries."""

    allocator: Any
    device: Any
    _order: Any
    _to_device: Any
    _lock: Any  # the pool's RLock
    _page_group: Any  # (HybridKVPool's: the group of a layer with pages / with state)
    _state_group: Any
    group: Any

    def check(self) -> None:
        """Verify every invariant of every group. See ``GroupedAllocator.check``."""
        self.allocator.check()

    def is_open(self, handle: Any) -> bool:
        return self.allocator.is_open(handle)

    def length(self, handle: Any) -> int:
        return self.allocator.length(handle)

    def lengths(self, handles: Any) -> np.ndarray:
        return self.allocator.lengths(handles)

    def rows(self, handles: Any) -> np.ndarray:
        return self.allocator.rows(handles)

    def known_tokens(self, handle: Any) -> np.ndarray:
        return self.allocator.known_tokens(handle)

    def take_events(self) -> dict[str, np.ndarray]:
        return self.allocator.take_events()

    def slots(self, handle: Any, layer: int) -> np.ndarray:
        """Every slot of the request in ``layer``'s group, in token order (released
        window positions read as the null page's slots)."""
        return self.allocator.slots(handle, self._page_group(layer).index)

    def pages(self, handle: Any, layer: int) -> np.ndarray:
        """The request's page list in ``layer``'s group (0 where the window released it)."""
        return self.allocator.pages(handle, self._page_group(layer).index)

    def held_tokens(self, handle: Any, layer: int) -> int:
        """Tokens' worth of pages the request holds in ``layer``'s group (held pages x page size)."""
        g = self._page_group(layer)
        return int(np.count_nonzero(self.allocator.pages(handle, g.index))) * g.page_size

    def page_table(self, handles: Any, layer: int) -> PageTable:
        """FlashInfer's CSR page table of ``layer``'s group: a sliding group's
        carries only each request's window pages. See ``GroupedAllocator.page_table``."""
        if self._order is not None:  # CUDA: its host -> device copy cannot be captured
            refuse_capture(self.device, "page_table")
        indptr, indices, last = self.allocator.page_table(handles, self._page_group(layer).index)
        return page_table_tensors(indptr, indices, last, self.device, self._to_device)

    def state_slots(self, handles: Any, layer: int) -> np.ndarray:
        """Each request's state slot in ``layer``'s group (read it again after truncate)."""
        return self.allocator.state_slots(handles, self._state_group(layer).index)

    @property
    def open_requests(self) -> int:
        return self.allocator.open_requests

    @property
    def admissible_requests(self) -> int:
        return self.allocator.admissible_requests

    @property
    def hit_tokens(self) -> int:
        return read_consistent(self._lock, lambda: self.allocator.hit_tokens)

    @property
    def miss_tokens(self) -> int:
        return read_consistent(self._lock, lambda: self.allocator.miss_tokens)

    @property
    def hash_seed(self) -> int:
        """The prefix hash seed; see ``GroupedAllocator.hash_seed``."""
        return self.allocator.hash_seed

    @property
    def kv_events(self) -> bool:
        """Whether the pool records KV events; see ``GroupedAllocator.kv_events``."""
        return self.allocator.kv_events

    @property
    def metadata_bytes(self) -> int:
        """Heap bytes of every group's bookkeeping and the request table (the plain pool's counter)."""
        return self.allocator.metadata_bytes

    @property
    def dropped_events(self) -> int:
        """KV events dropped because too many were left undrained (cumulative)."""
        return self.allocator.dropped_events

    def stats(self) -> dict[str, Any]:
        """The changing counters read under one lock (a metrics scrape or an engine's log line):
        ``open_requests``, ``hit_tokens``, ``miss_tokens``, ``dropped_events``, and ``groups``, one
        dict per group (``groups[i]`` is ``self.groups[i]``) of ``capacity_pages``, ``free_pages``,
        ``used_pages``, ``cached_pages`` and ``evictable_pages``. A dict, not the plain pool's
        ``PoolStats``: each group counts its own pages. See ``GroupedAllocator.stats``; read as
        the plain pool's ``stats`` is (``kvpool.lifecycle.read_consistent``)."""
        return read_consistent(self._lock, self.allocator.stats)

    def evictable_pages(self, layer: int) -> int:
        return self.allocator.evictable_pages(self.group(layer).index)

    def admissible_tokens(self, layer: int | None = None) -> int:
        """Tokens that can surely still be appended, pool-wide (``layer=None``) or in a layer's group."""
        return self.allocator.admissible_tokens(None if layer is None else self.group(layer).index)

    def free_pages(self, layer: int) -> int:
        return self.allocator.free_pages(self.group(layer).index)

    def used_pages(self, layer: int) -> int:
        return self.allocator.used_pages(self.group(layer).index)

    def cached_pages(self, layer: int) -> int:
        return self.allocator.cached_pages(self.group(layer).index)

    def capacity_pages(self, layer: int) -> int:
        return self.allocator.capacity_pages(self.group(layer).index)
