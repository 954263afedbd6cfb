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
import threading
import weakref
from typing import Any

import kvpool._core as _core

# Lock owner -> its (rank, attribute naming a lock) pairs; lower ranks are taken first.
_TRACKED: weakref.WeakKeyDictionary[Any, tuple[tuple[int, str], ...]] = weakref.WeakKeyDictionary()
# Locks the forking thread holds across its fork (one fork at a time: see _FORKING).
_HELD: list[Any] = []
# Guards _TRACKED's changes and counts them. The forking thread holds it across the fork,
# so a lock tracked by another thread meanwhile (a pool built during the fork) is either in
# what the hooks hold or waits until after the fork: never copied held into the child.
_REGISTRY = threading.Lock()
_generation = 0
# One fork at a time: two threads forking at once would share _HELD, and one's after-hook
# could release (or fail to release) the locks the other's before-hook had just taken.
_FORKING = threading.Lock()
# Tries to hold a stable set of locks before forking with what was held at the last try
# (a thread building a pool per request could otherwise keep a fork waiting).
_TRIES = 100

#: Ranks: a DiskCache call and a publisher's publish() take the pool's lock inside their
#: own; a publisher's buffer lock is taken inside its publish lock. INNER is also the rank of
#: every leaf lock, under which no other tracked lock is taken and which may itself be taken
#: under a pool's lock: the pinned staging ring's, the copy kernel's offsets tables', the
#: transformers cache's pool-views and buffer-spares locks. (Locks of one rank must never
#: nest: the hooks take them in no set order.)
OUTER, POOL, INNER = 0, 1, 2


class OwnedLock:
    """A ``threading.Lock`` that knows which thread holds it, for the outer locks held
    around user code (a ``TierBackend``'s ``put``, a publisher's ``_deliver``): a fork from
    inside such code finds its own thread holding the lock, which the before-fork hook then
    leaves as it is (taking it again would wait forever). Not reentrant, as a Lock."""

    __slots__ = ("_lock", "owner")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self.owner = threading.get_ident()
        return got

    def release(self) -> None:
        self.owner = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire_interruptible(lock: Any) -> None:
    """``lock.acquire()`` (a ``threading.RLock``) for the per-step calls that take it
    without ``with`` (cheaper on CPython). A signal handler's exception (Ctrl-C) can land
    just after ``acquire()`` returned, before the caller's ``try``: the lock would stay
    held and every other thread's pool call, and a fork's hooks, would wait for ever. So
    the lock is given back if this thread took it, and the exception goes on."""
    try:
        lock.acquire()
    except BaseException:
        if lock._is_owned():
            lock.release()
        raise


def track(owner: Any, attr: str, rank: int) -> None:
    """Hold ``getattr(owner, attr)`` (a threading lock) across every fork while ``owner`` lives."""
    global _generation
    with _REGISTRY:
        _TRACKED[owner] = (*_TRACKED.get(owner, ()), (rank, attr))
        _generation += 1


def _tracked() -> list[tuple[Any, tuple[tuple[int, str], ...]]]:
    # A garbage collection may drop an owner (a weak key) while this copies the dict, which
    # then raises "changed size during iteration"; a before-fork hook that raises is only
    # reported, the fork going ahead with no lock held. Copy again until it holds.
    while True:
        try:
            return list(_TRACKED.items())
        except RuntimeError:
            continue


def _take_tracked() -> list[Any]:
    """Every tracked lock not already this thread's, taken in rank order; returned taken."""
    me = threading.get_ident()
    locks = sorted(((rank, attr, owner) for owner, pairs in _tracked() for rank, attr in pairs),
                   key=lambda t: t[0])
    held: list[Any] = []
    try:
        for _, attr, owner in locks:
            lock = getattr(owner, attr)
            if getattr(lock, "owner", None) == me:  # forked from inside the call holding it
                continue
            lock.acquire()  # waits with the GIL released, so the holder can finish
            held.append(lock)
    except BaseException:  # (a hook's error is only reported: leave no lock held by it)
        for lock in reversed(held):
            lock.release()
        raise
    return held


def _before() -> None:
    _FORKING.acquire()
    for attempt in range(_TRIES):
        seen = _generation
        held = _take_tracked()
        _REGISTRY.acquire()
        if _generation == seen or attempt == _TRIES - 1:
            break
        # A lock was tracked while these were taken: it may be held; take the new set.
        _REGISTRY.release()
        for lock in reversed(held):
            lock.release()
    _HELD.extend(held)
    _HELD.append(_REGISTRY)
    _core._fork_prepare()


def _after() -> None:
    _core._fork_release()
    while _HELD:
        _HELD.pop().release()
    _FORKING.release()


os.register_at_fork(before=_before, after_in_parent=_after, after_in_child=_after)
