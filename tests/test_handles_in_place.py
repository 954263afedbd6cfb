"""extend and extend_packed take a contiguous int64 handles array with one
memcpy into a reused buffer (no conversion, no allocation), once, before
anything is written; every other form is converted. All of them must give
the same slots and leave the same pool, also when out= or table= is the
handles' own memory or another thread rewrites the array during calls."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool import InvalidHandleError, SlotAllocator


def twins(n: int = 2) -> list[SlotAllocator]:
    pools = [SlotAllocator(64, 4, 12, 64, handle_seed=4) for _ in range(n)]
    for a in pools:
        a.extend(a.open(6), [3, 4, 1, 0, 8, 2])
    return pools



@pytest.mark.parametrize(
    "form",
    ["int64", "list", "strided", "big-endian", "readonly", "fortran-2d-slice"],
)
def test_every_handles_form_gives_the_same_slots(form: str) -> None:
    a, b = twins()
    hs = a.open(3)
    assert np.array_equal(hs, b.open(3))
    wide = np.zeros(6, dtype=np.int64)
    wide[::2] = hs
    arg = {
        "int64": hs.copy(),
        "list": hs.tolist(),
        "strided": wide[::2],
        "big-endian": hs.astype(">i8"),
        "readonly": np.frombuffer(hs.tobytes(), dtype=np.int64),
        "fortran-2d-slice": np.asfortranarray(np.stack([hs, hs]))[0],
    }[form]
    got = a.extend(arg, [2, 5, 1])
    want = b.extend(hs.copy(), [2, 5, 1])
    assert got.tolist() == want.tolist()
    assert [a.slots(int(h)).tolist() for h in hs] == [b.slots(int(h)).tolist() for h in hs]
    a.check()


def test_out_over_the_handles_array_reads_the_handles_first() -> None:
    a, b = twins()
    hs = a.open(4)
    b.open(4)
    buf = hs.copy()  # the handles, and the buffer that receives the slots
    got = a.extend(buf, 1, out=buf)
    want = b.extend(hs, 1)
    assert got is buf and buf.tolist() == want.tolist()
    a.check()


def test_a_stale_handle_in_an_int64_array_is_refused_and_changes_nothing() -> None:
    (a,) = twins(1)
    hs = a.open(2)
    gone = a.open(1)
    a.close(gone)
    before = (a.free_pages, a.lengths(hs).tolist())
    with pytest.raises(InvalidHandleError):
        a.extend(np.array([hs[0], gone[0], hs[1]], dtype=np.int64), 1)
    assert (a.free_pages, a.lengths(hs).tolist()) == before
    a.check()


def test_extend_packed_reads_int64_handles_in_place_too() -> None:
    a, b = twins()
    hs = a.open(3)
    b.open(3)
    pa, na, _ = a.extend_packed(hs, [1, 4, 2])
    pb, nb, _ = b.extend_packed(hs.tolist(), [1, 4, 2])
    assert na == nb and np.array_equal(pa, pb)


def test_a_handles_array_rewritten_by_another_thread_never_corrupts_the_pool() -> None:
    # torch's copy_ releases the GIL, so another thread can rewrite the
    # handles array while an extend reads it (a race in the caller's code).
    # Whatever the call sees, it must see it once: a handle validated in
    # one pass and changed before the next would grow a request that was
    # never checked (or index past the rows).
    import threading
    import time
    from collections import Counter

    import torch

    from kvpool import KVPoolError

    a = SlotAllocator(1 << 14, page_size=16, max_requests=4096, max_context_len=1 << 20)
    hs = a.open(2048)
    arr = hs.copy()
    view = torch.from_numpy(arr)
    good = torch.from_numpy(hs.copy())
    bad = torch.full((hs.size,), 1 << 40, dtype=torch.int64)  # no such request
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            view.copy_(bad)
            view.copy_(good)

    writer = threading.Thread(target=rewrite)
    writer.start()
    outcomes: Counter = Counter()
    # A number of calls, not a time: a loaded machine gives the calling thread few turns
    # while the writer spins. The deadline only bounds a pathological run.
    deadline = time.monotonic() + 60
    try:
        for i in range(256):
            if time.monotonic() > deadline:
                break
            try:
                a.extend(arr, 1)
                outcomes["grew"] += 1
            except KVPoolError as e:
                outcomes[type(e).__name__] += 1
            if i % 64 == 63:
                a.truncate(hs, 0)
                a.check()
    finally:
        stop.set()
        writer.join()
    a.check()
    # Only the two outcomes the values allow: every handle good, or one is not.
    assert set(outcomes) <= {"grew", "InvalidHandleError"}, outcomes
    assert outcomes["grew"] + outcomes["InvalidHandleError"] > 100
