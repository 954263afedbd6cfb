"""Fork safety of kvpool's short-lived locks (the pinned staging ring, the copy kernel's
offsets tables, the transformers cache's pool views and buffer spares): a thread holding
one while another thread forks must not leave the child waiting on it forever.

Each test holds the lock in a thread until either the fork has happened (an at-fork hook
of this module says so) or someone else asks for the lock (the lock is wrapped to say
so). With kvpool's fork hooks the fork asks for the lock and waits for its release, so the
child gets it free; without them the fork completes while the lock is held, and the
child's first use of it waits forever (``forked`` kills it and fails the test). The hook's
copy of the tracked locks must also survive a thread tracking a new one meanwhile.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from forking import forked

import kvpool
from kvpool.integrations import _pool_views
from kvpool.integrations._layer_buffers import BufferSpares, LayerBuffers
from kvpool.kernels.copy_tables import OffsetTables
from kvpool.staging import PinnedRing

pytestmark = pytest.mark.skipif(sys.platform != "linux" or not hasattr(os, "register_at_fork"),
                                reason="forks a multi-threaded process: tested on Linux only")

HOLD_LIMIT_S = 10.0  # a holder that nothing wakes gives up (the test then fails on its check)

_FORKED = threading.Event()
os.register_at_fork(after_in_parent=_FORKED.set)  # registered once, for every test here


class _SpyLock:
    """A lock that says when a thread other than its holder asks for it."""

    def __init__(self) -> None:
        self._inner = threading.Lock()
        self.holder: int | None = None
        self.wanted = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self.holder is not None and self.holder != threading.get_ident():
            self.wanted.set()
        got = self._inner.acquire(blocking, timeout)
        if got:
            self.holder = threading.get_ident()
        return got

    def release(self) -> None:
        self.holder = None
        self._inner.release()

    def locked(self) -> bool:
        return self._inner.locked()

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextmanager
def _spy(owner: Any, attr: str) -> Iterator[_SpyLock]:
    old = getattr(owner, attr)
    spy = _SpyLock()
    setattr(owner, attr, spy)
    try:
        yield spy
    finally:
        setattr(owner, attr, old)


def _fork_while_held(owner: Any, attr: str, child: Callable[[], object]) -> None:
    """Forks while a thread holds ``getattr(owner, attr)``; ``child`` must finish in the child."""
    with _spy(owner, attr) as lock:
        held = threading.Event()

        def hold() -> None:
            with lock:
                held.set()
                for _ in range(int(HOLD_LIMIT_S * 100)):
                    if _FORKED.is_set() or lock.wanted.wait(0.01):
                        break

        _FORKED.clear()
        t = threading.Thread(target=hold, daemon=True)
        t.start()
        assert held.wait(HOLD_LIMIT_S)
        try:
            result = forked(child)
        finally:
            t.join(HOLD_LIMIT_S)
        # The fork waited for the holder (the hooks asked for the lock), instead of copying it held.
        assert lock.wanted.is_set()
        assert result == (0, "ok"), result


class _Event:
    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def test_fork_while_a_thread_holds_the_pinned_staging_ring():
    # A CPU stand-in for a CUDA pool's ring (plain host buffers, events that are always done):
    # the lock and the ring's bookkeeping are the same.
    ring = PinnedRing(torch.device("cpu"), alloc=lambda n: torch.empty(n, dtype=torch.uint8), make_event=_Event)
    ring.to_device(np.arange(4, dtype=np.int64))

    def child() -> str:
        got = ring.to_device(np.arange(6, dtype=np.int32))
        assert got.tolist() == list(range(6))
        return "ok"

    _fork_while_held(ring, "_lock", child)


def test_fork_while_a_thread_holds_the_copy_offsets_tables():
    tables = OffsetTables(capacity=4)
    caches = torch.zeros(3, 16)

    def child() -> str:
        table, align = tables.get([caches[0], caches[2]])
        assert table.tolist() == [0, 32 // align]
        return "ok"

    _fork_while_held(tables, "_lock", child)


def test_fork_while_a_thread_holds_the_shared_copy_offsets_tables_of_copy_slots():
    from kvpool.kernels.copy_tables import TABLES

    caches = torch.zeros(2, 8)

    def child() -> str:
        TABLES.get([caches[0], caches[1]])
        return "ok"

    _fork_while_held(TABLES, "_lock", child)


def _pool() -> kvpool.KVPool:
    return kvpool.KVPool(1, 1, 8, page_size=4, num_pages=8, max_requests=2, max_context_len=16,
                         dtype=torch.float32)


def test_fork_while_a_thread_is_making_a_pools_views():
    pool = _pool()

    def child() -> str:
        views = _pool_views.pool_views(pool)
        assert views.page == 4 and _pool_views.pool_views(pool) is views
        return "ok"

    _fork_while_held(_pool_views, "_MAKING", child)


def test_fork_while_a_thread_holds_a_pools_buffer_spares():
    spares = BufferSpares()
    like = torch.zeros(1)

    def child() -> str:
        lb = LayerBuffers(like, layers=1, b=1, h=1, cap=8, d=4)
        spares.give(lb)
        assert spares.take(1, 4, like) is lb and len(spares) == 0
        spares.clear()
        return "ok"

    _fork_while_held(spares, "_lock", child)


def test_fork_while_another_thread_tracks_a_new_lock(monkeypatch):
    # Copying the tracked locks races with a thread that builds a pool meanwhile (the copy
    # raises "changed size during iteration"); the hook must copy again, not give up.
    from kvpool import _forksafe

    class Racing(type(_forksafe._TRACKED)):
        raced = False

        def items(self):  # type: ignore[override]
            if not Racing.raced:
                Racing.raced = True
                raise RuntimeError("dictionary changed size during iteration")
            return super().items()

    racing = Racing()
    racing.update(_forksafe._TRACKED)
    monkeypatch.setattr(_forksafe, "_TRACKED", racing)
    tables = OffsetTables(capacity=4)
    caches = torch.zeros(2, 8)

    def child() -> str:
        tables.get([caches[0], caches[1]])
        return "ok"

    _fork_while_held(tables, "_lock", child)
    assert Racing.raced
