"""Interrupts raised from inside an argument's conversion.

Converting an argument may run the caller's Python code: an element's ``__index__``,
a number's ``__float__``, an object's ``__array__``. When that code is interrupted
(Ctrl-C's ``KeyboardInterrupt``, raised at whatever Python code runs when the signal
lands) or runs out of memory, the interrupt must reach the caller as it is and the
pool must be as before: turning it into an ``InvalidArgumentError`` made an engine that
refuses a bad request and carries on swallow the Ctrl-C (the same holds for any exception
that is not an ``Exception``, such as a task's cancellation). Any other ``Exception`` such
code raises is still the argument's fault, an ``InvalidArgumentError``.
"""

from __future__ import annotations

import asyncio

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


class Stop(BaseException):
    """A caller's own control-flow exception (not an ``Exception``), as trio's or gevent's."""


@pytest.mark.parametrize("exc", [asyncio.CancelledError, GeneratorExit, Stop])
def test_any_exception_that_is_not_an_exception_reaches_the_caller(exc: type[BaseException]) -> None:
    # docs/errors.md said everything but KeyboardInterrupt, SystemExit and
    # MemoryError became InvalidArgumentError; the bindings pass every non-Exception through
    # (a task's cancellation must not become a refusal), and the docs now say so.
    for call in sorted(CALLS):
        a, h = alloc()
        before = state(a, h)
        with pytest.raises(exc, match="raised while converting"):
            CALLS[call](a, h, Raising(exc))
        with pytest.raises(exc, match="raised while converting"):
            a.extend(RaisingArray(exc), 1)
        assert state(a, h) == before, call
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


# ----- a signal landing just as extend takes the pool's lock -----------------
# extend (and the transformers cache's host-only extend) take the pool's RLock with
# acquire() rather than `with` (cheaper per step). A signal handler runs after a call
# returns, so Ctrl-C landing right after acquire() raised outside the try that releases
# the lock: the main thread kept it for good, and every other thread's pool call (a
# publisher, a DiskCache, a fork from another thread) then waited forever.


class InterruptedLock:
    """The pool's RLock, whose next ``acquire`` raises KeyboardInterrupt: after taking
    the lock (``taken=True``: the signal landed as the call returned) or without it
    (``taken=False``: the signal interrupted the wait)."""

    def __init__(self, lock: object, taken: bool) -> None:
        self._inner, self.taken, self.armed = lock, taken, True

    def acquire(self, *args: object, **kwargs: object) -> bool:
        if self.armed:
            self.armed = False
            if self.taken:
                self._inner.acquire()
            raise KeyboardInterrupt("signal")
        return self._inner.acquire(*args, **kwargs)

    def release(self) -> None:
        self._inner.release()

    def _is_owned(self) -> bool:
        return self._inner._is_owned()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def free_for_another_thread(lock: object) -> bool:
    import threading

    got: list[bool] = []

    def take() -> None:
        ok = lock.acquire(timeout=5)
        if ok:
            lock.release()
        got.append(ok)

    t = threading.Thread(target=take)
    t.start()
    t.join()
    return got == [True]


@pytest.mark.parametrize("taken", [True, False])
@pytest.mark.parametrize("call", ["extend", "extend tokens", "_extend_host"])
def test_an_interrupt_as_extend_takes_the_lock_leaves_it_free(call: str, taken: bool) -> None:
    from kvpool import KVPool

    pool = KVPool(1, 1, 2, num_slots=32, max_requests=4, max_context_len=16)
    h = pool.open(2)
    pool.extend(h, [2, 3])
    before = (pool.stats(), pool.lengths(h).tolist(), pool.req_to_token.clone())
    real = pool._lock
    pool._lock = InterruptedLock(real, taken)
    with pytest.raises(KeyboardInterrupt, match="signal"):
        if call == "extend":
            pool.extend(h, [1, 1])
        elif call == "extend tokens":
            pool.extend(h, [1, 1], tokens=[5, 6])
        else:
            pool._extend_host(h, [1, 1])
    pool._lock = real
    assert not real._is_owned()
    assert free_for_another_thread(real)
    assert (pool.stats(), pool.lengths(h).tolist()) == before[:2]
    assert torch_equal(pool.req_to_token, before[2])
    pool.check()
    pool.extend(h, [1, 1])  # and the pool goes on
    assert pool.lengths(h).tolist() == [3, 4]


def torch_equal(a: object, b: object) -> bool:
    import torch

    return bool(torch.equal(a, b))


# ----- swap_in interrupted in its loads ----------------------------------------
# swap_in ran the host tier's loads after the core had moved the requests onto new
# device pages and before its roll-back's try: an interrupt (or a failed load) there
# left them on the device with req_to_token rows naming the pages they had before
# swap_out, while check() passed, so the next step read other requests' K/V.


def rows_agree(pool: object, handles: np.ndarray) -> bool:
    for h in handles:
        if pool.is_swapped(h):
            continue
        n, row = pool.length(h), int(pool.rows([h])[0])
        if pool.req_to_token[row, :n].tolist() != pool.slots(h).tolist():
            return False
    return True


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_swap_in_interrupted_in_its_loads_leaves_no_stale_rows(exc: type[BaseException]) -> None:
    import torch

    from kvpool import KVPool

    pool = KVPool(1, 1, 2, page_size=2, num_pages=16, max_requests=4, max_context_len=16, host_pages=16)
    h = pool.open(2)
    res = pool.extend(h, [3, 4])
    pool.write(0, res.slots, *[torch.arange(14.0).reshape(7, 1, 2).half()] * 2)
    pool.swap_out(h[:1])
    pool.extend(h[1:], [3])  # takes device pages: the swapped request comes back elsewhere
    runner = pool._transfers
    real_run = runner.run

    def interrupted(*args: object, **kwargs: object) -> object:
        runner.run = real_run
        raise exc("interrupted in the loads")

    runner.run = interrupted
    with pytest.raises(exc, match="interrupted in the loads"):
        pool.swap_in(h[:1])
    assert rows_agree(pool, h)
    assert pool.is_swapped(h[0])  # swapped out again, as a failed table write is
    pool.check()
    pool.swap_in(h[:1])
    assert rows_agree(pool, h)
    pool.check()

