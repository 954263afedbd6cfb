"""Interrupts raised from inside an argument's conversion (outside-style sweep).

Converting an argument may run the caller's Python code: an element's ``__index__``,
a number's ``__float__``, an object's ``__array__``. When that code is interrupted
(Ctrl-C's ``KeyboardInterrupt``, raised at whatever Python code runs when the signal
lands) or runs out of memory, the interrupt must reach the caller as it is and the
pool must be as before: turning it into an ``InvalidArgumentError`` made an engine that
refuses a bad request and carries on swallow the Ctrl-C. Any other exception such code
raises is still the argument's fault, an ``InvalidArgumentError``.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvpool import InvalidArgumentError, SlotAllocator


class Raising:
    """An int-like object whose conversion raises ``exc``."""

    def __init__(self, exc: type[BaseException]) -> None:
        self.exc, self.calls = exc, 0

    def __index__(self) -> int:
        self.calls += 1
        raise self.exc("raised while converting")

    __int__ = __index__

    def __float__(self) -> float:
        self.calls += 1
        raise self.exc("raised while converting")


class RaisingArray:
    """An array-like (no sequence protocol) whose ``__array__`` raises ``exc``."""

    def __init__(self, exc: type[BaseException]) -> None:
        self.exc, self.calls = exc, 0

    def __array__(self, *args: object, **kwargs: object) -> np.ndarray:
        self.calls += 1
        raise self.exc("raised while converting")


def alloc() -> tuple[SlotAllocator, np.ndarray]:
    a = SlotAllocator(32, page_size=1, max_requests=4, max_context_len=16)
    h = a.open(2)
    a.extend(h, [3, 2])
    return a, h


def state(a: SlotAllocator, h: np.ndarray) -> tuple:
    return (a.free_pages, a.used_pages, a.open_requests, a.lengths(h).tolist(),
            [a.slots(x).tolist() for x in h])


CALLS = {
    "open(n)": lambda a, h, x: a.open([x]),
    "extend(handles)": lambda a, h, x: a.extend([int(h[0]), x], 1),
    "extend(counts)": lambda a, h, x: a.extend(h, [1, x]),
    "extend(counts tuple)": lambda a, h, x: a.extend(h, (x, 1)),
    "truncate(lengths)": lambda a, h, x: a.truncate(h, [1, x]),
    "close(handles)": lambda a, h, x: a.close([x]),
    "lengths(handles)": lambda a, h, x: a.lengths([x]),
    "cache(retain_s)": lambda a, h, x: a.cache(h[:1], priority=50, retain_s=x),
}
ARRAY_CALLS = {
    "extend(handles)": lambda a, h, x: a.extend(x, 1),
    "close(handles)": lambda a, h, x: a.close(x),
    "page_table(handles)": lambda a, h, x: a.page_table(x),
}


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError, SystemExit])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_an_interrupt_in_an_elements_conversion_reaches_the_caller(call: str, exc: type[BaseException]) -> None:
    a, h = alloc()
    before = state(a, h)
    x = Raising(exc)
    with pytest.raises(exc, match="raised while converting"):
        CALLS[call](a, h, x)
    assert x.calls == 1
    assert state(a, h) == before
    a.check()


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
@pytest.mark.parametrize("call", sorted(ARRAY_CALLS))
def test_an_interrupt_in_dunder_array_reaches_the_caller(call: str, exc: type[BaseException]) -> None:
    a, h = alloc()
    before = state(a, h)
    x = RaisingArray(exc)
    with pytest.raises(exc, match="raised while converting"):
        ARRAY_CALLS[call](a, h, x)
    assert x.calls >= 1
    assert state(a, h) == before
    a.check()


@pytest.mark.parametrize("exc", [TypeError, ValueError, RuntimeError])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_other_errors_in_a_conversion_stay_typed(call: str, exc: type[BaseException]) -> None:
    a, h = alloc()
    before = state(a, h)
    with pytest.raises(InvalidArgumentError):
        CALLS[call](a, h, Raising(exc))
    with pytest.raises(InvalidArgumentError):
        a.extend(RaisingArray(exc), 1)
    assert state(a, h) == before
    a.check()
