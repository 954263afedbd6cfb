"""publish() from two threads: the sequence numbers follow the order in which
the batches were drained from the pool, so a consumer applying them in
sequence order sees the pool's events in the order they happened; and
LocalEventPublisher.drain() racing a publish() loses no message."""

import threading

import numpy as np
import pytest

import kvpool

pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
from kvpool.events import LocalEventPublisher, schema  # noqa: E402


def test_a_batch_drained_first_is_numbered_first():
    a = kvpool.SlotAllocator(16, 4, 4, 64, hash_seed=3)
    pub = LocalEventPublisher(a)
    real = pub._encode
    drained, later_done = threading.Event(), threading.Event()
    calls = []

    def slow_first(ts, rank):
        out = real(ts, rank)
        calls.append(out[1:])
        if len(calls) == 1:
            drained.set()
            later_done.wait(0.5)  # the scheduler thread is descheduled here
        return out

    pub._encode = slow_first
    toks = np.arange(100, 109)
    h, c = a.open_with_prefix(toks, [9])
    a.extend(h, 9)
    a.close(h, cache=True)  # Stored (2 pages)
    first = threading.Thread(target=pub.publish)
    first.start()
    assert drained.wait(5)
    assert a.evict(2) == 2  # Removed, drained by the second publish
    second = threading.Thread(target=lambda: (pub.publish(), later_done.set()))
    second.start()
    first.join(5)
    second.join(5)
    assert not first.is_alive() and not second.is_alive()
    by_seq = sorted(pub.drain(), key=lambda m: int.from_bytes(m[1], "big"))
    kinds = [type(e).__name__ for _, _, p in by_seq for e in schema.decoder().decode(p).events]
    assert kinds == ["BlockStored", "BlockRemoved"], "the Removed was numbered before the Stored it undoes"
    assert [int.from_bytes(s, "big") for _, s, _ in by_seq] == [0, 1]
    assert [s for _, s, _ in pub.replay(0)] == [m[1] for m in by_seq], "replay keeps sequence order"


def test_a_batch_published_while_another_thread_drains_is_not_lost():
    """LocalEventPublisher.drain() racing a publish(): the message lands in the
    outbox while drain() is reading it; it must come out of this drain or the
    next, never be cleared unseen."""
    from collections import deque

    a = kvpool.SlotAllocator(16, 4, 4, 64, hash_seed=3)
    pub = LocalEventPublisher(a)

    def admit(tokens):
        h, c = a.open_with_prefix(np.asarray(tokens), [len(tokens)])
        a.extend(h, len(tokens) - int(c[0]))
        a.close(h, cache=True)

    fired = []

    class Interleaved(deque):
        """An outbox on which the other thread's publish lands mid-drain."""

        def _land(self):
            if not fired:
                fired.append(1)
                admit(np.arange(200, 205))
                pub.publish()

        def clear(self):
            self._land()
            super().clear()

        def popleft(self):
            self._land()
            return super().popleft()

    admit(np.arange(100, 105))
    pub.publish()
    pub.outbox = Interleaved(pub.outbox)
    got = pub.drain() + pub.drain()
    assert fired and pub.batches == 2
    assert sorted(int.from_bytes(s, "big") for _, s, _ in got) == [0, 1]
