"""Several threads share one allocator, each extending, truncating and closing
its own requests; at the end no slot is lost or held twice and check() passes."""

import sys
import threading
import time

import numpy as np
import pytest

from kvpool import PoolExhaustedError, SlotAllocator

THREADS, ROUNDS = 4, 300


def worker(a, table, seed, owned, errors, barrier):
    rng = np.random.default_rng(seed)
    mine = {}  # handle -> slots in token order, as this thread saw them handed out
    barrier.wait()
    try:
        for _ in range(ROUNDS):
            if len(mine) < 4:
                for h in a.open(2):
                    mine[int(h)] = []
            hs = np.array(list(mine), dtype=np.int64)
            counts = rng.integers(0, 6, size=len(hs))
            try:
                slots = a.extend(hs, counts, table=table)  # one shared req_to_token
            except PoolExhaustedError:
                slots = None  # another thread holds the pages; atomic failure, retry later
            if slots is not None:
                k = 0
                for h, c in zip(hs, counts):
                    mine[int(h)] += slots[k : k + c].tolist()
                    k += c
            h = int(rng.choice(hs))
            if rng.random() < 0.3:
                new_len = int(rng.integers(0, len(mine[h]) + 1))
                a.truncate([h], new_len)
                del mine[h][new_len:]
            elif rng.random() < 0.2:
                a.close(h)
                del mine[h]
            for h, slots in mine.items():  # our view agrees with the allocator's
                if a.slots(h).tolist() != slots:
                    raise AssertionError(f"thread {seed}: request {h} slots diverged")
        owned[seed] = mine
    except BaseException as e:  # surfaced in the main thread
        errors.append(e)


def test_threads_share_one_allocator_without_losing_or_doubling_slots():
    a = SlotAllocator(2048, page_size=2, max_requests=THREADS * 6, max_context_len=512)
    table = np.full((a.max_requests, a.max_context_len), -1, dtype=np.int32)
    owned, errors = {}, []
    barrier = threading.Barrier(THREADS)
    threads = [threading.Thread(target=worker, args=(a, table, s, owned, errors, barrier)) for s in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    a.check()
    held = [s for mine in owned.values() for slots in mine.values() for s in slots]
    assert len(held) == len(set(held)), "a slot is owned by two requests"
    assert 0 not in held and all(0 < s < a.num_slots for s in held)
    pages = {s // a.page_size for s in held}
    assert a.used_pages == len(pages) and a.free_pages + len(pages) == a.capacity_pages
    assert a.open_requests == sum(len(m) for m in owned.values())
    for mine in owned.values():  # every thread's table writes landed in its own rows
        for h, slots in mine.items():
            assert table[h & 0xFFFFFFFF, : len(slots)].tolist() == slots
    a.reset()
    assert a.free_pages == a.capacity_pages
    a.check()


def _progress_during(call, setup, attempts=20):
    """Whether a ticking Python thread advanced during one ``call()``.

    With a 10 s switch interval the interpreter never forces a GIL hand-over
    within this test, and the ticker gives the GIL up itself (sleep(0)) after
    each tick; so its count can only move between the two reads below if the
    call itself released the GIL. ``setup()`` runs before each attempt."""
    ticks = [0]
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0)

    old = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    t = threading.Thread(target=ticker)
    try:
        t.start()
        for _ in range(attempts):  # an attempt can miss if the OS does not schedule the ticker
            setup()
            before = ticks[0]
            call()
            if ticks[0] > before:
                return True
        return False
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)


@pytest.mark.parametrize("op", ["extend", "truncate", "check"])
def test_gil_is_released_during_batch_work(op):
    """extend, truncate and check() each do milliseconds of work on 1M slots
    in one call; another Python thread must run meanwhile."""
    a = SlotAllocator((1 << 20) + 1, max_requests=256, max_context_len=4096)
    h = a.open(256)
    if op == "extend":
        setup, call = (lambda: a.truncate(h, 0)), (lambda: a.extend(h, 4096))
    elif op == "truncate":
        setup, call = (lambda: a.extend(h, 4096 - a.lengths(h))), (lambda: a.truncate(h, 0))
    else:
        a.extend(h, 4096)
        setup, call = (lambda: None), a.check
    assert _progress_during(call, setup)
    a.check()
