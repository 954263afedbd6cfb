"""extend and extend_packed read a contiguous int64 handles array in place
(no copy) when the call runs with the GIL held. Every other form, and an
array the call itself writes (out= or table= over the same memory), takes
the copy; all of them must give the same slots and leave the same pool."""

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
