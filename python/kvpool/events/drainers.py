"""Which publisher drains a pool's events.

A pool records one event stream, and each drain (``take_events``) takes what it returns
away from every other reader. A second publisher on the pool, or a ``DiskCache`` that
drains by itself while a publisher does, would each miss what the other took, silently:
a router behind the publisher would go on predicting prefixes the pool has evicted. So a
pool has at most one open publisher, and other readers take the events the engine
drained once (``events=``).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

__all__ = ["claim", "publisher_of", "release"]

# id(allocator) -> (its open publisher, the process that made it). A publisher holds its
# pool (and so the allocator) while it lives, so an id here cannot be reused by another
# allocator meanwhile. One inherited through os.fork() cannot send (ZmqEventPublisher
# refuses it), so a forked child may give its copy of the pool a publisher of its own.
_PUBLISHERS: dict[int, tuple[weakref.ref, int]] = {}
_LOCK = threading.Lock()


def _allocator(pool: Any) -> Any:
    return getattr(pool, "allocator", pool)


def publisher_of(pool: Any) -> Any | None:
    """The open publisher draining ``pool``'s events, or None."""
    entry = _PUBLISHERS.get(id(_allocator(pool)))
    pub = entry[0]() if entry is not None and entry[1] == os.getpid() else None
    return None if pub is None or pub.closed else pub


def claim(pool: Any, publisher: Any) -> Any | None:
    """Make ``publisher`` the one draining ``pool``; returns the open publisher already
    draining it instead (then nothing changes)."""
    with _LOCK:
        other = publisher_of(pool)
        if other is not None:
            return other
        _PUBLISHERS[id(_allocator(pool))] = (weakref.ref(publisher), os.getpid())
        return None


def release(pool: Any, publisher: Any) -> None:
    """``publisher`` no longer drains ``pool`` (closed)."""
    with _LOCK:
        key = id(_allocator(pool))
        entry = _PUBLISHERS.get(key)
        if entry is not None and entry[0]() in (publisher, None):
            del _PUBLISHERS[key]
