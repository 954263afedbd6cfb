"""The allocator's request operations, queries and counters, forwarded by ``KVPool``.

Engines talk to the pool only; ``pool.allocator`` stays reachable for tests and
tools but is never needed for ordinary work. Everything here is a direct call
into the Rust ``SlotAllocator`` (one crossing, no torch), so the pool adds
nothing to its cost but an uncontended lock. Handles are the ints ``open`` returns; batch arguments
take a Python int, a sequence of ints, a 1-D integer numpy array or a CPU
tensor. Every call that fails raises a ``KVPoolError`` subclass and changes
nothing. Calls that change ownership hold the pool's lock (``KVPool``'s
"Threads"), so they wait while another thread's extend runs its
copy-on-write copies; queries and counters take only the core's own lock.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool._core import PoolStats, SlotAllocator

__all__ = ["RequestOps"]


def _counter(name: str, doc: str) -> property:
    def get(self: RequestOps) -> int:
        return getattr(self.allocator, name)

    get.__name__ = name
    return property(get, doc=doc)


class RequestOps:
    """Mixin: the allocator-only part of ``KVPool``'s API (no tensors involved)."""

    allocator: SlotAllocator
    _lock: Any  # the pool's RLock

    # ----- counters (each one read under the allocator's lock) ----------------

    free_pages = _counter("free_pages", "Pages an extend can take now: free plus evictable cached pages.")
    used_pages = _counter("used_pages", "Pages held by open requests (``capacity_pages - free_pages``).")
    free_slots = _counter("free_slots", "``free_pages * page_size``.")
    used_slots = _counter("used_slots", "Slots in held pages, the unfilled tail of each last page included.")
    capacity_pages = _counter("capacity_pages", "Pages requests can ever hold: ``num_pages - 1`` (page 0 is reserved).")
    capacity_slots = _counter("capacity_slots", "``capacity_pages * page_size``.")
    open_requests = _counter("open_requests", "Requests opened and not yet closed.")
    admissible_tokens = _counter(
        "admissible_tokens",
        "Tokens that can surely still be appended (a lower bound: partly filled last pages take a few more).",
    )
    metadata_bytes = _counter("metadata_bytes", "Host bytes of the allocator's bookkeeping.")
    cached_pages = _counter("cached_pages", "Pages registered in the prefix cache (held or not).")
    evictable_pages = _counter("evictable_pages", "Cached pages nobody holds: evicted (LRU) when pages run out.")
    hit_tokens = _counter("hit_tokens", "Prompt tokens ``open_with_prefix`` served from the cache (cumulative).")
    miss_tokens = _counter("miss_tokens", "Prompt tokens ``open_with_prefix`` found no cached page for (cumulative).")
    dropped_events = _counter(
        "dropped_events",
        "Events dropped because more than max(num_pages, 65536) were left undrained (cumulative; see ``take_events``).",
    )

    def stats(self) -> PoolStats:
        """All the changing counters as one consistent snapshot (one lock), for logs and metrics.

        Returns:
            ``PoolStats`` with ``free_pages``, ``used_pages``, ``free_slots``,
            ``used_slots``, ``open_requests``, ``admissible_tokens``, ``metadata_bytes``,
            ``cached_pages``, ``evictable_pages``, ``hit_tokens``, ``miss_tokens``.
        """
        return self.allocator.stats()

    # ----- request lifecycle --------------------------------------------------

    def open(self, n: int = 1) -> np.ndarray:
        """Open ``n`` empty requests (no pages are taken until they grow).

        Args:
            n: how many requests (>= 0).

        Returns:
            int64 array of ``n`` handles.

        Raises:
            TooManyRequestsError: more than ``max_requests`` would be open.
            InvalidArgumentError: ``n`` is negative or not an int.
        """
        with self._lock:
            return self.allocator.open(n)

    def truncate(self, handles: Any, lengths: Any) -> None:
        """Shorten requests to ``lengths`` tokens, freeing pages no longer needed.

        Table entries past the new length are left stale: readers stop at the
        sequence length and the next ``extend`` overwrites them.

        Args:
            handles: the requests (no duplicates).
            lengths: new length per request, or one int for all; each at most
                the request's current length.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            InvalidArgumentError: a length is negative or longer than the
                request, mismatched sizes, a duplicate handle.
        """
        with self._lock:
            self.allocator.truncate(handles, lengths)

    def close(self, handles: Any, cache: bool = False) -> None:
        """Close requests and release all their pages; their handles become stale.

        Args:
            handles: the requests (no duplicates).
            cache: first register each request's full pages of known tokens in
                the prefix cache (as ``cache``), so later prompts can reuse them.

        Raises:
            InvalidHandleError: a handle is unknown, already closed or stale.
            InvalidArgumentError: a duplicate handle.
        """
        with self._lock:
            self.allocator.close(handles, cache=cache)

    def cache(self, handles: Any) -> None:
        """Register every full page of each request whose token ids are all known
        and that is not registered yet, so that later prompts can hit it.

        Call it once the step that wrote those pages has run (every step, or
        only at close with ``close(cache=True)``). When the same content is
        registered already, the existing copy is kept.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            InvalidArgumentError: a duplicate handle.
        """
        with self._lock:
            self.allocator.cache(handles)

    def evict(self, n_pages: int) -> int:
        """Evict up to ``n_pages`` cached pages nobody holds, least recently used
        first (a chain's tail before its parents). Extends evict by themselves
        when free pages run out; this is for engines that keep headroom.

        Returns:
            How many pages were evicted.

        Raises:
            InvalidArgumentError: ``n_pages`` is negative or not an int.
        """
        with self._lock:
            return self.allocator.evict(n_pages)

    def clear_cache(self) -> None:
        """Drop every prefix-cache entry: cached pages become free; pages held by
        open requests stay with them. Records one Cleared event."""
        with self._lock:
            self.allocator.clear_cache()

    def take_events(self) -> dict[str, np.ndarray]:
        """Drain the KV cache events (Stored / Removed / Cleared, what vLLM's
        ``KVEventBatch`` carries) as one numpy array per field; see
        ``SlotAllocator.take_events``. Events accumulate until drained (or pass
        ``kv_events=False`` to the pool), up to max(num_pages, 65536): past that the
        backlog is replaced by one Cleared event, so a router forgets this pool's pages
        and relearns them from the Stored events that follow (``dropped_events``
        counts what was dropped)."""
        return self.allocator.take_events()

    def known_tokens(self, handle: Any) -> np.ndarray:
        """Token ids of request ``handle``'s leading known positions (int32).

        Raises:
            InvalidHandleError: unknown, closed or stale handle.
        """
        return self.allocator.known_tokens(handle)

    def reset(self) -> None:
        """Close every request and free every page (all handles become stale).

        ``req_to_token`` is not cleared: no handle can read it any more, and
        each new request's ``extend`` writes its own entries.
        """
        with self._lock:
            self.allocator.reset()

    # ----- queries --------------------------------------------------------------

    def is_open(self, handle: Any) -> bool:
        """Whether ``handle`` is an open request (never raises for a bad handle)."""
        return self.allocator.is_open(handle)

    def length(self, handle: Any) -> int:
        """Tokens request ``handle`` holds.

        Raises:
            InvalidHandleError: unknown, closed or stale handle.
        """
        return self.allocator.length(handle)

    def lengths(self, handles: Any) -> np.ndarray:
        """Tokens each request holds, as an int64 array (the engine's ``seq_lens``).

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
        """
        return self.allocator.lengths(handles)

    def rows(self, handles: Any) -> np.ndarray:
        """Each request's row of ``req_to_token`` (int64; fixed while the request is open).

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
        """
        return self.allocator.rows(handles)

    def slots(self, handle: Any) -> np.ndarray:
        """Every slot of request ``handle`` in token order (int64), as ``req_to_token`` holds them.

        Raises:
            InvalidHandleError: unknown, closed or stale handle.
        """
        return self.allocator.slots(handle)

    def pages(self, handle: Any) -> np.ndarray:
        """The pages request ``handle`` holds, in token order (int32).

        Raises:
            InvalidHandleError: unknown, closed or stale handle.
        """
        return self.allocator.pages(handle)

    def check(self) -> None:
        """Verify every allocator invariant (free + held = capacity, no page in two
        places, owners match holders). Cheap enough to call after every step in tests.

        Raises:
            InvariantError: an invariant is broken (a bug in kvpool); the message says which.
        """
        self.allocator.check()
