"""Host-time accounting for kvpool calls, kept apart from the engine's own work."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

# Allocator bookkeeping (who owns which slot) versus moving K/V data into the buffers.
BOOKKEEPING = ("open", "admit", "open_with_prefix", "extend", "truncate", "cache", "fork", "close", "rows", "page_table")
STORES = ("write",)


class TimedPool:
    """Forwards everything to a KVPool, timing the host side of its calls.

    The model and the engine talk to this proxy, so every pool call in the demo is
    counted; attribute reads (buffers, req_to_token) pass through untimed. On CUDA
    the times are launch/host times (the store kernels run asynchronously), which is
    exactly the share of the scheduler's step the pool costs.
    """

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        for name in BOOKKEEPING + STORES:
            if hasattr(pool, name):
                setattr(self, name, self._timed(name, getattr(pool, name)))

    def _timed(self, name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
        call.__name__ = name
        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    @property
    def inner(self) -> Any:
        return self._pool

    def total(self, names: tuple[str, ...]) -> float:
        return sum(self.seconds.get(n, 0.0) for n in names)
