"""The bindings' unsafe blocks against hostile Python inputs (an audit of each site).

Every raw pointer the bindings read or write comes from a caller's numpy array
or torch tensor. These tests pin what each such path assumes about that object
and that a caller who breaks the assumption gets a typed error (or, for
``scatter_rows``, a decline to torch's own path), never a read or write outside
the object's memory, and the pool unchanged.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvpool import GroupedAllocator, InvalidArgumentError, KVPoolError, SlotAllocator
from kvpool._core import scatter_rows
from kvpool.rows import scatter_into

# scatter_rows stores in place only through torch's DLPack C exchange API; a torch without it
# (2.4) declines every call to torch's own path, so these cases of the in-place path skip there.
NEEDS_EXCHANGE_API = pytest.mark.skipif(not hasattr(torch._C, "_dlpack_exchange_api"),
                                        reason="this torch has no DLPack C exchange API: scatter_rows declines every call")


def alloc() -> SlotAllocator:
    return SlotAllocator(64, page_size=4, max_requests=4, max_context_len=16)


def state(a: SlotAllocator, handles: np.ndarray) -> tuple:
    return (a.free_pages, a.used_pages, a.open_requests, a.lengths(handles).tobytes(),
            tuple(a.slots(h).tobytes() for h in handles))


def grouped() -> GroupedAllocator:
    g = {"kind": "full", "num_pages": 32, "page_size": 4}
    return GroupedAllocator([g, dict(g)], max_requests=4, max_context_len=16)


# ----- torch tensors whose storage was shrunk below their shape -------------
# DLPack describes a tensor's shape, not its storage: after
# `t.untyped_storage().resize_(n)` the view still claims the old extent, and the
# in-place readers used to read (handles, tokens) or write (scatter_rows' caches)
# past the storage. torch's own ops refuse such a tensor.

def shrunk(values: list[int], keep_bytes: int) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.int64)
    t.untyped_storage().resize_(keep_bytes)
    return t


@pytest.mark.parametrize("keep", [0, 8], ids=["no-storage", "one-item-left"])
def test_handles_tensor_past_its_storage_is_refused(keep: int) -> None:
    a = alloc()
    h = a.open(3)
    before = state(a, h)
    with pytest.raises(InvalidArgumentError, match="handles: .*past its storage"):
        a.extend(shrunk(h.tolist(), keep), 1)
    assert state(a, h) == before


def test_tokens_and_counts_tensors_past_their_storage_are_refused() -> None:
    a = alloc()
    h = a.open(1)
    before = state(a, h)
    with pytest.raises(InvalidArgumentError, match="tokens: .*past its storage"):
        a.extend(h, [4], tokens=shrunk([1, 2, 3, 4], 8))
    with pytest.raises(InvalidArgumentError, match="counts: .*past its storage"):
        a.extend(h, shrunk([4], 0))
    assert state(a, h) == before


def test_tensor_view_whose_end_passes_the_shrunk_storage_is_refused() -> None:
    """A view at a storage offset: its start lies in the storage, its end no longer does."""
    a = alloc()
    h = a.open(2)
    base = torch.tensor([0, *h.tolist(), 0], dtype=torch.int64)
    view = base[1:3]
    base.untyped_storage().resize_(16)  # keeps base[0] and base[1] only
    with pytest.raises(InvalidArgumentError, match="past its storage"):
        a.extend(view, 1)
    # The same view over a whole storage reads fine.
    assert a.extend(torch.tensor([0, *h.tolist(), 0])[1:3], 1).shape == (2,)


def test_the_storage_check_ignores_python_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bounds come from torch's C methods, not overridable Tensor attributes."""
    def lying(self: torch.Tensor) -> torch.UntypedStorage:
        return torch.UntypedStorage(1 << 20)

    t = shrunk([1], 0)
    monkeypatch.setattr(torch.Tensor, "untyped_storage", lying)
    a = alloc()
    a.open(1)
    with pytest.raises(InvalidArgumentError, match="past its storage"):
        a.extend(t, 1)


@pytest.mark.parametrize("which", ["dst", "src", "slots"])
def test_scatter_rows_declines_a_tensor_past_its_storage(which: str) -> None:
    """Each shrunk to part of its first row or item: before the check a cache shrunk to 64
    bytes took a write at row 63 (16 KiB past it), and a shrunk source or slot tensor was
    read past its storage."""
    dst, src, slots = torch.zeros(64, 64), torch.full((2, 64), 7.0), torch.tensor([62, 63])
    {"dst": dst, "src": src, "slots": slots}[which].untyped_storage().resize_(
        {"dst": 64, "src": 256, "slots": 8}[which])
    assert scatter_rows((dst,), slots, (src,)) == -1
    # kvpool's store then takes torch's path, which refuses the tensor itself.
    assert scatter_into((dst,), slots, (src,)) is False


@NEEDS_EXCHANGE_API
def test_scatter_rows_still_takes_views_inside_their_storage() -> None:
    base = torch.zeros(10, 4)
    assert scatter_rows((base[2:],), torch.tensor([7]), (torch.ones(1, 4),)) == 1
    assert base[9].tolist() == [1.0] * 4 and base[:9].sum() == 0


# ----- numpy table= / out= layouts the raw writes rely on -------------------

def _unaligned_table() -> np.ndarray:
    raw = np.zeros(4 * 16 * 4 + 4, np.uint8)
    return raw[1:1 + 256].view(np.int32).reshape(4, 16)


def _zero_row_stride() -> np.ndarray:
    return np.lib.stride_tricks.as_strided(np.zeros(16, np.int32), (4, 16), (0, 4), writeable=True)


def _read_only() -> np.ndarray:
    t = np.zeros((4, 16), np.int32)
    t.flags.writeable = False
    return t


BAD_TABLES = {
    "unaligned": _unaligned_table,
    "reversed-rows": lambda: np.zeros((4, 16), np.int32)[::-1],
    "reversed-columns": lambda: np.zeros((4, 16), np.int32)[:, ::-1],
    "zero-row-stride": _zero_row_stride,
    "column-major": lambda: np.asfortranarray(np.zeros((4, 16), np.int32)),
    "read-only": _read_only,
    "too-small": lambda: np.zeros((4, 15), np.int32),
    "int64": lambda: np.zeros((4, 16), np.int64),
}


@pytest.mark.parametrize("make", BAD_TABLES.values(), ids=BAD_TABLES.keys())
def test_a_table_the_raw_write_cannot_take_is_refused(make) -> None:
    a = alloc()
    h = a.open(1)
    before = state(a, h)
    with pytest.raises(InvalidArgumentError, match="table"):
        a.extend(h, [3], table=make())
    assert state(a, h) == before


def test_a_padded_row_stride_writes_only_inside_each_row() -> None:
    a = alloc()
    h = a.open(4)
    wide = np.full((4, 40), -7, np.int32)
    a.extend(h, [3, 1, 2, 4], table=wide[:, :16])
    assert (wide[:, 16:] == -7).all()


@pytest.mark.parametrize("offset", [0, 60], ids=["same-buffer", "partial-overlap"])
def test_out_sharing_memory_with_table_is_refused(offset: int) -> None:
    a = alloc()
    h = a.open(1)
    buf = np.zeros(4 * 16 * 2 + 8, np.int32)
    table = buf[:64].reshape(4, 16)
    before = state(a, h)
    with pytest.raises(InvalidArgumentError, match="share memory"):
        a.extend(h, [3], table=table, out=buf[offset:offset + 16].view(np.int64))
    assert state(a, h) == before


def test_out_aliasing_the_handles_reads_the_handles_first() -> None:
    """handles are copied before the detached section writes out: out may be their buffer."""
    a, b = alloc(), alloc()
    ha, hb = a.open(2), b.open(2)
    buf = np.zeros(8, np.int64)
    buf[:2] = ha
    got = a.extend(buf[:2], [2, 2], out=buf)
    assert got is buf
    assert (buf[:4] == b.extend(hb, [2, 2])).all()
    assert a.lengths(ha).tolist() == [2, 2]


def test_tokens_aliasing_the_table_are_read_before_the_table_is_written() -> None:
    a = alloc()
    h = a.open(1)
    table = np.zeros((4, 16), np.int32)
    row = int(a.rows(h)[0])
    table[row, :4] = [11, 12, 13, 14]
    a.extend(h, [4], table=table, tokens=table[row, :4])
    assert a.known_tokens(int(h[0])).tolist() == [11, 12, 13, 14]


def test_a_table_from_tensor_numpy_pins_the_tensor_storage() -> None:
    """The documented way to pass a torch table (``tensor.numpy()``) marks the storage
    non-resizable, so no thread can free it under a detached write; the write lands."""
    a = alloc()
    h = a.open(1)
    owner = torch.zeros(4, 16, dtype=torch.int32)
    table = owner.numpy()
    with pytest.raises(RuntimeError, match="not resizable"):
        owner.untyped_storage().resize_(0)
    slots = a.extend(h, [3], table=table)
    assert owner[int(a.rows(h)[0]), :3].tolist() == slots.tolist()


# ----- Python code that runs mid-call ---------------------------------------

class Mutates:
    """An int whose __index__ runs `f` first (the call converts it after other arguments)."""

    def __init__(self, f) -> None:
        self.f = f

    def __index__(self) -> int:
        self.f()
        return 1


def test_a_table_is_validated_after_every_python_callback() -> None:
    """extend converts the tokens (running their __index__) before it looks at the
    table: a callback that resizes the table (nothing of kvpool holds it yet, so the
    unchecked resize is sound) is seen, not written past."""
    a = alloc()
    h = a.open(1)
    table = np.zeros((4, 16), np.int32)
    before = state(a, h)
    with pytest.raises(InvalidArgumentError, match="table shape"):
        a.extend(h, [1], table=table, tokens=[Mutates(lambda: table.resize((1, 1), refcheck=False))])
    assert table.shape == (1, 1)
    assert state(a, h) == before


@pytest.mark.parametrize("call", ["admit", "open_with_prefix"])
def test_admit_and_open_with_prefix_validate_the_table_last(call: str) -> None:
    a = alloc()
    table = np.zeros((4, 16), np.int32)
    shrink = Mutates(lambda: table.resize((1, 1), refcheck=False))
    with pytest.raises(InvalidArgumentError, match="table shape"):
        if call == "admit":
            a.admit([2], table=table, tokens=[shrink, 1])
        else:
            a.open_with_prefix([shrink, 1, 2], [3], table=table)
    assert a.open_requests == 0 and a.used_pages == 0


def handles_resized_to(size: int) -> tuple[SlotAllocator, np.ndarray, np.ndarray, Mutates]:
    """A pool with three requests, an int64 array of the first two of their handles, and
    a count whose __index__ resizes that array to the first ``size`` handles."""
    a = alloc()
    h, _ = a.admit([3, 4, 5])
    handles = h[:2].copy()

    def resize() -> None:
        handles.resize(size, refcheck=False)
        handles[:] = h[:size]

    return a, h, handles, Mutates(resize)


@pytest.mark.parametrize("call", ["extend", "extend_packed"])
@pytest.mark.parametrize("size", [1, 3], ids=["shrunk", "grown"])
def test_handles_resized_by_an_index_call_are_refused(call: str, size: int) -> None:
    """The handles array is measured when the call begins and the results sized by it
    (extend_packed's header says how many requests it describes); a count's __index__
    that resizes the array is seen when the handles are read, and the call refuses it
    with nothing changed, rather than extending a batch its results do not describe."""
    a, h, handles, count = handles_resized_to(size)
    before = state(a, h)
    with pytest.raises(InvalidArgumentError, match="handles had 2 entries"):
        getattr(a, call)(handles, [count, 1])
    assert state(a, h) == before


@pytest.mark.parametrize("size", [1, 3], ids=["shrunk", "grown"])
def test_extend_with_starts_extends_the_handles_it_was_given(size: int) -> None:
    """extend_with_starts copies the handles before it converts the counts: a resize
    then changes nothing it reads, and it extends the two requests it was given."""
    a, h, handles, count = handles_resized_to(size)
    slots, starts = a.extend_with_starts(handles, [count, 1])
    assert starts.tolist() == [3, 4] and len(slots) == 2
    assert a.lengths(h).tolist() == [4, 5, 5]


def test_grouped_tables_emptied_by_an_index_call_is_refused() -> None:
    g = grouped()
    tables = [np.zeros((4, 16), np.int32), np.zeros((4, 16), np.int32)]
    with pytest.raises(InvalidArgumentError, match="tables has 0 entries"):
        g.admit([Mutates(tables.clear)], tables=tables)


@pytest.mark.parametrize("rows", [(0, 4), (1, 5)], ids=["same", "shifted"])
def test_grouped_tables_that_overlap_are_refused(rows: tuple[int, int]) -> None:
    g = grouped()
    buf = np.zeros((5, 16), np.int32)
    with pytest.raises(InvalidArgumentError, match="overlaps"):
        g.admit([3], tables=[buf[:4], buf[rows[0]:rows[1]]])


def test_tables_list_rebound_by_another_thread_during_extends() -> None:
    """Each Table holds its array: another thread emptying and refilling the list (the
    only reference to the old arrays) while extends run detached leaves them intact."""
    g = grouped()
    tables = [np.zeros((4, 16), np.int32), np.zeros((4, 16), np.int32)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        while not stop.is_set():
            tables[:] = [np.zeros((4, 16), np.int32), np.zeros((4, 16), np.int32)]
            tables.clear()

    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        for _ in range(300):
            try:
                h, _ = g.admit([3], tables=list(tables) or None)
                g.close(h)
            except KVPoolError as e:  # a snapshot of an empty list: wrong count, typed
                errors.append(e)
    finally:
        stop.set()
        t.join(timeout=30)
    assert not t.is_alive()
    assert all(isinstance(e, InvalidArgumentError) for e in errors)
    g.check()


def test_tables_arrays_dropped_by_another_thread_stay_alive() -> None:
    g = grouped()
    box: list[list[np.ndarray]] = [[np.zeros((4, 16), np.int32), np.zeros((4, 16), np.int32)]]
    stop = threading.Event()

    def drop() -> None:
        while not stop.is_set():
            box[0] = [np.zeros((4, 16), np.int32), np.zeros((4, 16), np.int32)]

    t = threading.Thread(target=drop, daemon=True)
    t.start()
    try:
        for _ in range(300):
            mine = box[0]
            h, slots = g.admit([5], tables=mine)
            row = int(g.rows(h)[0])
            assert all((tab[row, :5] == s).all() for tab, s in zip(mine, slots))
            g.close(h)
    finally:
        stop.set()
        t.join(timeout=30)
    assert not t.is_alive()
    g.check()
