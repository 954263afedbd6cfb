"""A drain of KV events that is re-entered on its own thread.

``take_events`` (and ``take_events_msgpack``) hold a lock on the events a failed drain
kept back while they build Python objects, and building them can run a garbage
collection, whose finalizers run on the same thread. A finalizer that drained the same
pool then waited for a lock its own thread held: the process hung. It now gets a
RuntimeError (as Python's buffered files do on a reentrant call) and the outer drain
goes on. A garbage collection cannot be made to land inside the lock from a test, so
the test-only hook ``SlotAllocator._while_draining_for_tests(callback)`` (the bindings'
``test-hooks`` feature, as ``test_events_short_drain.py``) calls ``callback`` holding
that lock, where such a finalizer would run.
"""

import numpy as np
import pytest

from kvpool import SlotAllocator

HOOK = "_while_draining_for_tests"


def pool_with_events() -> SlotAllocator:
    a = SlotAllocator(16, page_size=1, max_requests=4, max_context_len=64)
    h = a.open(1)
    a.extend(h, 5, tokens=np.arange(5, dtype=np.int64))
    a.close(h, cache=True)  # five Stored events
    return a


def hook_of(a: SlotAllocator):
    hook = getattr(a, HOOK, None)
    if hook is None:
        pytest.skip(f"SlotAllocator.{HOOK} is not in this build (build with the test-hooks feature)")
    return hook


@pytest.mark.parametrize("drain", ["take_events", "take_events_msgpack"])
def test_a_drain_of_the_same_pool_inside_a_drain_raises_instead_of_hanging(drain):
    a = pool_with_events()
    hook = hook_of(a)
    with pytest.raises(RuntimeError, match="reentrant take_events"):
        hook(a.take_events if drain == "take_events" else lambda: a.take_events_msgpack(0.0))
    # Nothing was drained by the refused call, and the lock and this thread's note of it
    # are gone: the next drain takes every event.
    kinds = a.take_events()["kind"]
    assert list(kinds) == [0] * 5
    assert len(a.take_events()["kind"]) == 0


def test_another_pool_drains_inside_a_drain():
    a, b = pool_with_events(), pool_with_events()
    inner = hook_of(a)(b.take_events)
    assert list(inner["kind"]) == [0] * 5
    assert len(a.take_events()["kind"]) == 5


def test_the_refusal_is_per_thread():
    """Another thread's drain of the same pool waits for the lock and then drains: only a
    drain on the thread that holds it is refused."""
    import threading

    a = pool_with_events()
    got: list[int] = []

    def drain_elsewhere():
        t = threading.Thread(target=lambda: got.append(len(a.take_events()["kind"])))
        t.start()
        t.join(timeout=0.2)
        assert t.is_alive(), "the other thread should wait while this one holds the lock"
        return t

    t = hook_of(a)(drain_elsewhere)
    t.join(timeout=30)
    assert not t.is_alive() and got == [5]
