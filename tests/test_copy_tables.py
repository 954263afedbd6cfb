"""Lifetime of copy_slots' offsets tables (kernels/copy_tables.py).

A CUDA graph that captured a copy_slots launch reads its table by raw address and
holds no reference to it, so a table used during capture must never be freed; and
per-layer calls over many cache sets must not evict a table before the capture that
needs it. Stream capture is mocked here (is_capturing), so this runs on CPU."""

from __future__ import annotations

import pytest
import torch

from kvpool.kernels import copy_tables
from kvpool.kernels._common import KernelArgumentError
from kvpool.kernels.copy_tables import OffsetTables


@pytest.fixture
def capturing(monkeypatch):
    state = {"on": False}
    monkeypatch.setattr(copy_tables, "is_capturing", lambda t: state["on"])
    return state


def _sets(n, caches_per_set=2):
    return [[torch.zeros((16, 2, 8), dtype=torch.float16) for _ in range(caches_per_set)] for _ in range(n)]


def test_table_holds_the_cache_offsets():
    block = torch.zeros((4, 16, 2, 8), dtype=torch.float16)
    group = [block[0], block[2], block[1]]
    table, align = OffsetTables().get(group)
    assert align == 8  # 16 bytes of fp16
    want = [(t.data_ptr() - group[0].data_ptr()) // 2 for t in group]
    assert [x * align for x in table.tolist()] == want
    assert table.dtype == torch.int64 and table.device == group[0].device


def test_captured_table_outlives_any_number_of_later_sets(capturing):
    tables = OffsetTables(capacity=4)
    layer0 = _sets(1)[0]
    eager = tables.get(layer0)                 # warm-up
    capturing["on"] = True
    captured = tables.get(layer0)              # the launch a graph records
    capturing["on"] = False
    assert captured[0] is eager[0] and tables.pinned == 1
    ptr = captured[0].data_ptr()
    for group in _sets(20):                    # more sets than the LRU holds
        tables.get(group)
    again = tables.get(layer0)
    assert again[0] is captured[0] and again[0].data_ptr() == ptr
    assert len(tables) == 4 + 1                # eager LRU full, the pinned table kept


def test_eager_tables_stay_bounded(capturing):
    tables = OffsetTables(capacity=3)
    for group in _sets(10):
        tables.get(group)
    assert len(tables) == 3 and tables.pinned == 0


def test_per_layer_warmup_over_many_sets_then_capture(capturing):
    """The reported failure: 32 layers' caches warmed up one set per layer, then captured
    in the same order. With the old 16-entry LRU layer 0's table was gone by then."""
    tables = OffsetTables()
    layers = _sets(32)
    warm = [tables.get(g)[0] for g in layers]
    capturing["on"] = True
    got = [tables.get(g)[0] for g in layers]
    capturing["on"] = False
    assert all(a is b for a, b in zip(warm, got)) and tables.pinned == 32


def test_capture_without_warmup_is_a_clear_error(capturing):
    tables = OffsetTables(capacity=2)
    first, *others = _sets(4)
    tables.get(first)
    for g in others:                           # evicts `first` (never captured)
        tables.get(g)
    capturing["on"] = True
    with pytest.raises(KernelArgumentError, match="warm-up"):
        tables.get(first)
    with pytest.raises(KernelArgumentError, match="before capturing"):
        tables.get(_sets(1)[0])
    assert tables.pinned == 0


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad"])
def test_table_is_a_normal_tensor_in_every_grad_mode(mode):
    ctx = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad,
           "grad": torch.enable_grad}[mode]
    with ctx():
        table, _ = OffsetTables().get(_sets(1)[0])
    assert not table.is_inference() and not table.requires_grad


@pytest.fixture
def streams(monkeypatch):
    """Fake current stream per call, and the record_stream calls made on eviction."""
    state = {"current": "s0", "recorded": []}
    monkeypatch.setattr(copy_tables, "current_stream", lambda t: state["current"])
    monkeypatch.setattr(copy_tables, "record_stream",
                        lambda table, stream: state["recorded"].append((table.data_ptr(), stream)))
    return state


def test_evicted_table_is_kept_for_every_stream_that_read_it(capturing, streams):
    """A table built on one stream and read by a copy queued on another: evicting it
    must mark it in use by both, or the allocator hands its memory to the next
    allocation on the first stream while the copy on the second has yet to run."""
    tables = OffsetTables(capacity=2)
    first, second, third = _sets(3)
    table, _ = tables.get(first)               # built on s0
    streams["current"] = "side"
    tables.get(first)                          # read by a copy on the side stream
    tables.get(first)                          # again: one record per stream
    streams["current"] = "s0"
    tables.get(second)
    assert streams["recorded"] == []           # nothing evicted yet
    tables.get(third)                          # evicts `first` (least recently used)
    assert sorted(streams["recorded"]) == sorted([(table.data_ptr(), "s0"), (table.data_ptr(), "side")])


def test_tables_still_cached_or_pinned_are_not_released(capturing, streams):
    tables = OffsetTables(capacity=1)
    graph_set, other = _sets(2)
    tables.get(graph_set)
    capturing["on"] = True
    tables.get(graph_set)                      # pinned for a graph
    capturing["on"] = False
    tables.get(other)
    assert streams["recorded"] == [] and tables.pinned == 1 and len(tables) == 2


def test_cpu_tables_record_no_stream(capturing):
    """On CPU nothing is queued: eviction needs no stream bookkeeping (and CPU tensors
    have no record_stream)."""
    tables = OffsetTables(capacity=1)
    for group in _sets(3):
        tables.get(group)
    assert len(tables) == 1


def test_threads_sharing_the_tables_never_see_a_half_made_eviction():
    """An engine thread and the tiers' transfer threads copy at once: one thread's LRU move of
    a key another thread is evicting must not fail (a KeyError from ``move_to_end``)."""
    import sys
    import threading

    tables = OffsetTables(capacity=2)
    sets = _sets(6)
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for i in range(6000):
                tables.get(sets[(i + offset) % len(sets)])
        except BaseException as e:  # noqa: BLE001 - the test reports whatever escaped
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:1]
    assert len(tables) <= 2
