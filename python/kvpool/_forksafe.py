"""Fork safety: ``os.fork()`` (multiprocessing's ``fork`` start method, DataLoader
workers) while another thread is inside a pool call would copy that call's locks,
held, into a child where no thread will ever release them: the child's first call
on its copy of the pool would wait forever.

Hooks registered with ``os.register_at_fork`` prevent that. Before the fork they
wait until every tracked lock is free and hold it (outer locks first: a
``DiskCache`` call or a publisher's ``publish()`` holds its own lock, then the pool's,
then the allocator's mutexes, so the hooks take them in that order; short-lived leaf
locks such as the staging ring's sit with the innermost Python ones), then release
everything after it, in the parent and in the child. The child then has a consistent
copy of each pool (CPU tensors copy-on-write; a CUDA pool cannot be used after a fork,
as CUDA itself cannot). Forking costs one wait for the calls in flight to finish.
``subprocess`` does not run these hooks and needs none: it runs no Python in the
child.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import kvpool._core as _core

# Lock owner -> its (rank, attribute naming a lock) pairs; lower ranks are taken first.
_TRACKED: weakref.WeakKeyDictionary[Any, tuple[tuple[int, str], ...]] = weakref.WeakKeyDictionary()
_HELD: list[Any] = []

#: Ranks: a DiskCache call and a publisher's publish() take the pool's lock inside their
#: own; a publisher's buffer lock is taken inside its publish lock. INNER is also the rank of
#: every leaf lock, under which no other tracked lock is taken and which may itself be taken
#: under a pool's lock: the pinned staging ring's, the copy kernel's offsets tables', the
#: transformers cache's pool-views and buffer-spares locks. (Locks of one rank must never
#: nest: the hooks take them in no set order.)
OUTER, POOL, INNER = 0, 1, 2


def track(owner: Any, attr: str, rank: int) -> None:
    """Hold ``getattr(owner, attr)`` (a threading lock) across every fork while ``owner`` lives."""
    _TRACKED[owner] = (*_TRACKED.get(owner, ()), (rank, attr))


def _tracked() -> list[tuple[Any, tuple[tuple[int, str], ...]]]:
    # Another thread may build a pool (and track its lock) while this one forks: copying the
    # dict then raises "changed size during iteration", and a before-fork hook that raises
    # is only reported, the fork going ahead with no lock held. Copy again until it holds.
    while True:
        try:
            return list(_TRACKED.items())
        except RuntimeError:
            continue


def _before() -> None:
    locks = sorted(((rank, attr, owner) for owner, pairs in _tracked() for rank, attr in pairs),
                   key=lambda t: t[0])
    for _, attr, owner in locks:
        lock = getattr(owner, attr)
        lock.acquire()  # waits with the GIL released, so the holder can finish
        _HELD.append(lock)
    _core._fork_prepare()


def _after() -> None:
    _core._fork_release()
    while _HELD:
        _HELD.pop().release()


os.register_at_fork(before=_before, after_in_parent=_after, after_in_child=_after)
