"""``OnceIndex``: a handle-like argument that carries its own conversion code (``__index__``),
which works a set number of times and then raises: what docs/errors.md calls an argument's own
conversion code. A pool that reads a call's handles again after the core committed runs it a
second time (the plain and the hybrid pool's refusal tests)."""

from __future__ import annotations


class OnceIndex:
    """``__index__`` returns ``value`` ``ok`` times, then raises ``exc``."""

    def __init__(self, value, ok, exc):
        self.value, self.ok, self.exc, self.calls = value, ok, exc, 0

    def __index__(self):
        self.calls += 1
        if self.calls > self.ok:
            raise self.exc
        return self.value
