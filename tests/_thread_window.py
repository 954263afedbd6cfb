"""Start another thread's edit inside the window between a cache step's edit check and its
extend: the thread tests of the plain and the hybrid ``KVPoolCache`` share this hook."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence


def start_at_call(pool, at_call: int, other: Callable[[], object],
                  names: Sequence[str] = ("extend",)) -> list[tuple[threading.Thread, bool]]:
    """Start ``other()`` in another thread at the ``at_call``-th call, by the calling thread, of
    the pool methods ``names`` (counted together), and give it up to 0.5 s to finish first.
    Returns each thread started with whether it was still waiting then: where the cache holds the
    pool's lock from its check to its extend, the other thread's edit (which takes that lock) must
    wait for the step, whatever the timing. The hooks are instance attributes (``del`` them to
    restore the methods); the caller joins the threads."""
    calls: list[int] = [0]
    started: list[tuple[threading.Thread, bool]] = []
    owner = threading.get_ident()

    def wrap(real):
        def hooked(*a, **kw):
            if threading.get_ident() == owner:
                calls[0] += 1
                if calls[0] == at_call:
                    t = threading.Thread(target=other, daemon=True)
                    t.start()
                    t.join(0.5)  # (not an assertion by itself: either order can be valid)
                    started.append((t, t.is_alive()))
            return real(*a, **kw)
        return hooked

    for name in names:
        setattr(pool, name, wrap(getattr(pool, name)))
    return started
