"""The allocator's request operations, queries and counters, forwarded by ``KVPool``.

Engines talk to the pool only; ``pool.allocator`` stays reachable for tests and
tools but is never needed for ordinary work. Everything here is a direct call
into the Rust ``SlotAllocator`` (one crossing, no torch), so the pool adds
nothing to its cost but an uncontended lock.

One home per contract: each method's arguments, results and errors are those of
the ``SlotAllocator`` method of the same name (``help(kvpool.SlotAllocator.open)``,
``_core.pyi``), and its docstring here says only what the pool adds: the lock
(calls that change ownership hold the pool's lock, so they wait while another
thread's extend runs its copy-on-write copies; queries and counters take only
the core's own lock) and the tables. ``tests/test_forwarding_docs.py`` keeps it so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import numpy as np

from kvpool._core import PoolStats, SlotAllocator
from kvpool.handle_args import frozen_handles
from kvpool.validate import check_flag

__all__ = ["RequestOps", "read_consistent"]

# How long a snapshot waits for a pool call in flight on another thread. Pool calls hold the
# pool's lock for micro- to milliseconds; a request transfer holds it for its whole length (up
# to its timeout_s), and a Prometheus scrape must not stall that long (its own timeout is 10 s).
SNAPSHOT_WAIT_S = 1.0


def read_consistent(lock: Any, read: Any) -> Any:
    """``read()`` under the pool's ``lock``, so that it never sees a call half done (an open
    the pool undoes after the core counted its prompt); past ``SNAPSHOT_WAIT_S`` of another
    thread holding it, ``read()`` without it (the core's own lock still makes it one
    snapshot)."""
    if lock.acquire(timeout=SNAPSHOT_WAIT_S):
        try:
            return read()
        finally:
            lock.release()
    return read()


_T = TypeVar("_T")


class _Counter(property, Generic[_T]):
    """A ``property`` whose value type static checkers know (``_counter``'s ``kind``: mypy
    reads a plain ``property`` object assigned in a class body as ``Any``). The typed
    ``__get__`` exists for them only, so a read runs ``property``'s own C ``__get__``."""

    if TYPE_CHECKING:
        @overload
        def __get__(self, instance: None, owner: type | None = None, /) -> _Counter[_T]: ...
        @overload
        def __get__(self, instance: object, owner: type | None = None, /) -> _T: ...
        def __get__(self, instance: object, owner: type | None = None, /) -> Any: ...


def _counter(name: str, kind: type[_T], consistent: bool = False) -> _Counter[_T]:
    """``SlotAllocator.<name>``, read under the allocator's lock, with its docstring (and
    ``kind`` as its return annotation, which runtime type checkers enforce, and as its type
    for static checkers). ``consistent``: a counter a pool call may take back when it undoes
    itself, read as ``stats()`` is."""

    def get(self: RequestOps) -> Any:
        if consistent:
            return read_consistent(self._lock, lambda: getattr(self.allocator, name))
        return getattr(self.allocator, name)

    get.__name__ = name
    get.__annotations__ = {"self": "RequestOps", "return": kind}
    prop: _Counter[_T] = _Counter(get)
    # Set, not passed as doc=: CPython 3.11 drops a property subclass's doc= for the class's own.
    prop.__doc__ = getattr(SlotAllocator, name).__doc__
    return prop


class RequestOps:
    """Mixin: the allocator-only part of ``KVPool``'s API (no tensors involved)."""

    allocator: SlotAllocator
    _lock: Any  # the pool's RLock
    _transfers: Any  # the host tier's TransferRunner (None without a tier)
    _run_transfers: Any
    _refuse_transfers_in_capture: Any
    _note_edit: Any  # (kvpool.row_edits)

    # ----- counters (each one read under the allocator's lock) ----------------

    free_pages = _counter("free_pages", int)
    used_pages = _counter("used_pages", int)
    free_slots = _counter("free_slots", int)
    used_slots = _counter("used_slots", int)
    capacity_pages = _counter("capacity_pages", int)
    capacity_slots = _counter("capacity_slots", int)
    open_requests = _counter("open_requests", int)
    admissible_tokens = _counter("admissible_tokens", int)
    metadata_bytes = _counter("metadata_bytes", int)
    cached_pages = _counter("cached_pages", int)
    evictable_pages = _counter("evictable_pages", int)
    hit_tokens = _counter("hit_tokens", int, consistent=True)
    miss_tokens = _counter("miss_tokens", int, consistent=True)
    dropped_events = _counter("dropped_events", int)
    kv_events = _counter("kv_events", bool)
    host_pages = _counter("host_pages", int)
    host_free_pages = _counter("host_free_pages", int)
    host_cached_pages = _counter("host_cached_pages", int)
    host_hit_tokens = _counter("host_hit_tokens", int, consistent=True)
    pinned_pages = _counter("pinned_pages", int)
    max_pinned_pages = _counter("max_pinned_pages", int)
    clock = _counter("clock", float)
    hash_seed = _counter("hash_seed", int)

    def stats(self) -> PoolStats:
        """All the changing counters as one consistent snapshot, for logs and metrics.
        See ``SlotAllocator.stats``; holds the pool's lock, so it never sees a call
        half done (an open the pool undoes after the core counted its prompt), waiting
        at most ``SNAPSHOT_WAIT_S`` for another thread's call (a request transfer holds
        the lock for its whole length)."""
        return read_consistent(self._lock, self.allocator.stats)

    # ----- request lifecycle --------------------------------------------------

    def open(self, n: int = 1) -> np.ndarray:
        """Open ``n`` empty requests. See ``SlotAllocator.open``; holds the pool's lock."""
        with self._lock:
            return self.allocator.open(n)

    def truncate(self, handles: Any, lengths: Any) -> None:
        """Shorten requests, freeing pages no longer needed. See ``SlotAllocator.truncate``;
        holds the pool's lock.

        ``req_to_token`` entries past the new length are left stale: readers stop
        at the sequence length and the next ``extend`` overwrites them.
        """
        handles = frozen_handles(handles)  # (read again after the core commits: convert once)
        with self._lock:
            self.allocator.truncate(handles, lengths)
            self._note_edit(handles)

    def _truncate_keeping_prompts(self, handles: Any, lengths: Any) -> None:
        """``truncate`` that leaves each request the prompt it was opened with
        (``SlotAllocator.roll_back_extend``), under the pool's lock: a request cut back
        inside its prompt takes the prompt's token ids again as it extends past the cut,
        so ``cache`` publishes those positions as the prompt's."""
        handles = frozen_handles(handles)  # (read again after the core commits: convert once)
        with self._lock:
            self.allocator.roll_back_extend(handles, lengths)
            self._note_edit(handles)

    def close(self, handles: Any, cache: bool = False, priority: Any = None, retain_s: Any = None) -> None:
        """Close requests and release their pages (with ``cache=True``, cached first,
        with a retention ``priority`` for ``retain_s`` seconds if given). See
        ``SlotAllocator.close``; holds the pool's lock.

        Raises:
            TensorDeviceError: ``cache=True`` on a CUDA pool with a write_through host
                tier while its stream is capturing a CUDA graph (the offloads cannot be
                captured); nothing changed.
        """
        cache = check_flag("cache", cache)  # (an array's truth value raised untyped)
        handles = frozen_handles(handles)  # (read again after the core commits: convert once)
        with self._lock:
            if cache:
                self._refuse_transfers_in_capture("close", "write_through")
            self.allocator.close(handles, cache=cache, priority=priority, retain_s=retain_s)
            self._note_edit(handles)
            if self._transfers is not None:  # the host tier's offloads
                self._run_transfers()

    def cache(self, handles: Any, priority: Any = None, retain_s: Any = None) -> None:
        """Publish requests' full pages in the prefix cache, with a retention
        ``priority`` (0-100; 100 with no ``retain_s`` pins) for ``retain_s`` seconds if
        given. See ``SlotAllocator.cache``; holds the pool's lock. Call it once the step
        that wrote those pages has run (every step, or only at close with
        ``close(cache=True)``).

        Raises:
            TensorDeviceError: a CUDA pool with a write_through host tier while its
                stream is capturing a CUDA graph (the offloads cannot be captured);
                nothing changed.
        """
        with self._lock:
            self._refuse_transfers_in_capture("cache", "write_through")
            self.allocator.cache(handles, priority=priority, retain_s=retain_s)
            if self._transfers is not None:  # the host tier's offloads
                self._run_transfers()

    def unpin(self, handles: Any) -> int:
        """Give the pinned pages of requests' cached prefixes the default priority.
        See ``SlotAllocator.unpin``; holds the pool's lock."""
        with self._lock:
            return self.allocator.unpin(handles)

    def set_clock(self, now: float) -> None:
        """Move a manual clock (``KVPool(manual_clock=True)``) to ``now`` seconds.
        See ``SlotAllocator.set_clock``; holds the pool's lock."""
        with self._lock:
            self.allocator.set_clock(now)

    def evictable_pages_by_priority(self) -> np.ndarray:
        """Evictable pages at each retention priority 0..100.
        See ``SlotAllocator.evictable_pages_by_priority``."""
        return self.allocator.evictable_pages_by_priority()

    def evict(self, n_pages: int) -> int:
        """Evict cached pages nobody holds. See ``SlotAllocator.evict``; holds the pool's
        lock. Extends evict by themselves when free pages run out; this is for
        engines that keep headroom.

        Raises:
            TensorDeviceError: a CUDA pool with a write_back host tier while its stream
                is capturing a CUDA graph (the offloads cannot be captured); nothing
                changed.
        """
        with self._lock:
            self._refuse_transfers_in_capture("evict", "write_back")
            n = self.allocator.evict(n_pages)
            if self._transfers is not None:  # write_back: the evicted pages' offloads
                self._run_transfers()
            return n

    def clear_cache(self) -> None:
        """Drop every prefix-cache entry. See ``SlotAllocator.clear_cache``; holds the
        pool's lock."""
        with self._lock:
            self.allocator.clear_cache()

    def take_events(self) -> dict[str, np.ndarray]:
        """Drain the KV cache events. See ``SlotAllocator.take_events``; a pool built
        with ``kv_events=False`` records none."""
        return self.allocator.take_events()

    def known_tokens(self, handle: Any) -> np.ndarray:
        """Token ids of a request's leading known positions. See ``SlotAllocator.known_tokens``."""
        return self.allocator.known_tokens(handle)

    def reset(self) -> None:
        """Close every request and release the pages they hold (the prefix cache stays).
        See ``SlotAllocator.reset``; holds the pool's lock.

        ``req_to_token`` is not cleared: no handle can read it any more, and
        each new request's ``extend`` writes its own entries.
        """
        with self._lock:
            self.allocator.reset()
            self._note_edit(None)

    # ----- queries --------------------------------------------------------------

    def is_open(self, handle: Any) -> bool:
        """Whether ``handle`` is an open request. See ``SlotAllocator.is_open``."""
        return self.allocator.is_open(handle)

    def length(self, handle: Any) -> int:
        """Tokens request ``handle`` holds. See ``SlotAllocator.length``."""
        return self.allocator.length(handle)

    def lengths(self, handles: Any) -> np.ndarray:
        """Tokens each request holds (the engine's ``seq_lens``). See ``SlotAllocator.lengths``."""
        return self.allocator.lengths(handles)

    def rows(self, handles: Any) -> np.ndarray:
        """Each request's row of ``req_to_token``. See ``SlotAllocator.rows``."""
        return self.allocator.rows(handles)

    def slots(self, handle: Any) -> np.ndarray:
        """Every slot of a request in token order, as ``req_to_token`` holds them.
        See ``SlotAllocator.slots``."""
        return self.allocator.slots(handle)

    def pages(self, handle: Any) -> np.ndarray:
        """The pages a request holds, in token order. See ``SlotAllocator.pages``."""
        return self.allocator.pages(handle)

    def check(self) -> None:
        """Verify every allocator invariant (cheap enough after every step in tests).
        See ``SlotAllocator.check``."""
        self.allocator.check()
