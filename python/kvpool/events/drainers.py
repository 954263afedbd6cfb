"""Which publisher drains a pool's events.

A pool records one event stream, and each drain (``take_events``) takes what it returns
away from every other reader. A second publisher on the pool, a ``DiskCache`` that
drains by itself while a publisher does, or a second ``DiskCache`` that drains by itself
(``claim_self_drain``), would each miss what the other took, silently:
a router behind the publisher would go on predicting prefixes the pool has evicted. So a
pool has at most one open publisher, and other readers take the events the engine
drained once (``events=``).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

__all__ = ["claim", "claim_self_drain", "publisher_of", "release"]

# id(allocator) -> its open publisher. A publisher holds its pool (and so the allocator)
# while it lives, so an id here cannot be reused by another allocator meanwhile. One
# inherited through os.fork() drains there only if it still can (``_drains_here``: a
# ZmqEventPublisher cannot, so a forked child may give its copy of the pool its own).
_PUBLISHERS: dict[int, weakref.ref] = {}
# id(allocator) -> the DiskCache that drains it by itself (store_new() without events): a second
# one doing so would split the pool's Stored pages between the two, each storing only its share.
_SELF_DRAINERS: dict[int, weakref.ref] = {}
_LOCK = threading.Lock()


def _new_lock_in_child() -> None:
    # A fork while another thread held the lock would leave the child's copy held forever.
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def _allocator(pool: Any) -> Any:
    return getattr(pool, "allocator", pool)


def publisher_of(pool: Any) -> Any | None:
    """The open publisher draining ``pool``'s events, or None."""
    ref = _PUBLISHERS.get(id(_allocator(pool)))
    pub = ref() if ref is not None else None
    return None if pub is None or pub.closed or not pub._drains_here() else pub


def claim(pool: Any, publisher: Any) -> Any | None:
    """Make ``publisher`` the one draining ``pool``; returns the open publisher already
    draining it instead (then nothing changes)."""
    with _LOCK:
        other = publisher_of(pool)
        if other is not None:
            return other
        # Publishers collected without close() leave dead entries (release never ran for them);
        # drop them here, under the lock, rather than in a weakref callback, which a collection
        # could run on a thread that holds the lock already.
        for key in [k for k, r in _PUBLISHERS.items() if r() is None]:
            del _PUBLISHERS[key]
        _PUBLISHERS[id(_allocator(pool))] = weakref.ref(publisher)
        return None


def release(pool: Any, publisher: Any) -> None:
    """``publisher`` no longer drains ``pool`` (closed)."""
    with _LOCK:
        key = id(_allocator(pool))
        ref = _PUBLISHERS.get(key)
        if ref is not None and ref() in (publisher, None):
            del _PUBLISHERS[key]


def claim_self_drain(pool: Any, reader: Any) -> Any | None:
    """Make ``reader`` (a ``DiskCache``) the one that drains ``pool`` by itself; returns the live
    other reader that already does instead (then nothing changes)."""
    with _LOCK:
        key = id(_allocator(pool))
        ref = _SELF_DRAINERS.get(key)
        other = ref() if ref is not None else None
        if other is not None and other is not reader and _allocator(other.pool) is _allocator(pool):
            return other
        for k in [k for k, r in _SELF_DRAINERS.items() if r() is None]:
            del _SELF_DRAINERS[k]
        _SELF_DRAINERS[key] = weakref.ref(reader)
        return None
