"""PinnedRing (kvpool/staging.py): the pool's host -> device copies go through pinned
buffers that are refilled only after the copy that read them has run, and the ring
grows rather than making the host wait. Pinned memory and CUDA events need a GPU, so
here they are fakes with the same interface; the copy target is the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool.staging import PinnedRing


class FakeEvent:
    """A CUDA event whose completion the test controls."""

    def __init__(self, log):
        self.done, self.log = True, log

    def record(self, stream=None):
        self.done = False
        self.log.append(("record", id(self)))

    def query(self):
        return self.done

    def synchronize(self):
        self.log.append(("wait", id(self)))
        self.done = True


@pytest.fixture
def ring_parts():
    log, events, allocs = [], [], []

    def make_event():
        events.append(FakeEvent(log))
        return events[-1]

    def alloc(nbytes):
        allocs.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    return log, events, allocs, make_event, alloc


def test_values_arrive_intact(ring_parts):
    _, _, _, make_event, alloc = ring_parts
    ring = PinnedRing(torch.device("cpu"), alloc=alloc, make_event=make_event)
    for a in (np.arange(5, dtype=np.int64), np.array([[1, 2], [3, 4]], dtype=np.int32), np.zeros(0, np.int64)):
        got = ring.to_device(a)
        assert got.dtype == torch.from_numpy(a).dtype and got.shape == a.shape
        assert np.array_equal(got.numpy(), a)


def test_busy_buffers_are_never_refilled_ring_grows_instead(ring_parts):
    log, events, allocs, make_event, alloc = ring_parts
    ring = PinnedRing(torch.device("cpu"), alloc=alloc, make_event=make_event, min_bytes=64)
    outs = [ring.to_device(np.full(4, i, dtype=np.int64)) for i in range(5)]  # GPU "never runs"
    assert ring.depth == 5 and not any(e == "wait" for e, _ in log)
    # Every copy still holds its own values: no buffer was overwritten while in flight.
    assert [int(o[0]) for o in outs] == [0, 1, 2, 3, 4]
    for e in events:
        e.done = True  # the GPU caught up
    n_alloc = len(allocs)
    for i in range(20):
        ring.to_device(np.full(4, i, dtype=np.int64))
        for e in events:
            e.done = True
    assert ring.depth == 5 and len(allocs) == n_alloc  # steady state: reuse, no allocation


def test_waits_only_past_max_depth(ring_parts):
    log, events, _, make_event, alloc = ring_parts
    ring = PinnedRing(torch.device("cpu"), alloc=alloc, make_event=make_event, max_depth=3)
    for i in range(3):
        ring.to_device(np.full(2, i, dtype=np.int64))
    assert not any(e == "wait" for e, _ in log)
    ring.to_device(np.full(2, 9, dtype=np.int64))
    assert ring.depth == 3 and [e for e, _ in log].count("wait") == 1
    assert ("wait", id(events[0])) in log  # the oldest copy


def test_buffer_grows_for_a_larger_update(ring_parts):
    _, events, allocs, make_event, alloc = ring_parts
    ring = PinnedRing(torch.device("cpu"), alloc=alloc, make_event=make_event, min_bytes=64)
    ring.to_device(np.zeros(4, np.int64))
    events[0].done = True
    big = np.arange(1000, dtype=np.int64)
    got = ring.to_device(big)
    assert ring.depth == 1 and allocs == [64, 8192]
    assert np.array_equal(got.numpy(), big)
