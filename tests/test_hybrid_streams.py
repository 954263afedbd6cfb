"""The stream contract of a hybrid pool on CUDA (kvpool/streams.py), on CPU with fakes.

As the plain pool's: calls that copy host data to the device (open, extend, admit,
fork, open_with_prefix, page_table, truncate; with state groups cache and close(cache=True))
raise ``TensorDeviceError`` while its device
is capturing a CUDA graph, before the core changes anything (the copies would
fail inside the capture with the core already committed); and the copies the
core queued (copy-on-write of a shared page, state zeroing and forks) are
recorded, so that a later call handing out slots from another stream first makes
that stream wait for them (the slot a copy reads may be freed and handed out
again once the lock is released).

On CPU the device path is taken by giving the pool a ``CopyOrder`` over fake
streams and events (what a CUDA hybrid pool builds); capture is faked by
patching ``kvpool.streams.capturing``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_hybrid_pool import fill, make

from kvpool import streams
from kvpool.errors import TensorDeviceError
from kvpool.streams import CopyOrder


class FakeEvent:
    def __init__(self, log: list) -> None:
        self.log = log

    def record(self, stream=None):
        self.log.append(("record", stream.name))


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(("wait", self.name))


def device_path(pool, log: list, current: list):
    pool._order = CopyOrder(pool.device, make_event=lambda: FakeEvent(log), current_stream=lambda: current[0])
    return pool


def test_calls_that_copy_host_data_are_refused_during_capture(monkeypatch):
    log: list = []
    pool = device_path(make(max_requests=8), log, [FakeStream("compute", log)])
    h = pool.open(2)
    fill(pool, pool.extend(h, [6, 9]))
    prompt = np.arange(100, 112, dtype=np.int32)
    p, _ = pool.open_with_prefix(prompt, [12])
    pool.extend(p, 12, tokens=prompt)
    pool.cache(p)
    lengths = pool.lengths(h).tolist()
    before = (pool.open_requests, [t.clone() for t in pool._tables if t is not None],
              [s.clone() for states in pool._states if states for s in states.values()])
    monkeypatch.setattr(streams, "capturing", lambda device: True)
    calls = {
        "open": lambda: pool.open(1),
        "extend": lambda: pool.extend(h, 1),
        "admit": lambda: pool.admit([3]),
        "fork": lambda: pool.fork(int(h[0]), 1),
        "open_with_prefix": lambda: pool.open_with_prefix(prompt, [12]),
        "page_table": lambda: pool.page_table(h, 1),
        # (rewrites sliding table rows, restores state rows: host data to the device as well)
        "truncate": lambda: pool.truncate(h, 0),
    }
    for name, call in calls.items():
        with pytest.raises(TensorDeviceError, match="being captured") as e:
            call()
        assert name in str(e.value)
        pool.check()
        after = (pool.open_requests, [t.clone() for t in pool._tables if t is not None],
                 [s.clone() for states in pool._states if states for s in states.values()])
        assert after[0] == before[0] and all(torch.equal(a, b) for a, b in zip(after[1], before[1])), name
        assert all(torch.equal(a, b) for a, b in zip(after[2], before[2])), name
    assert pool.lengths(h).tolist() == lengths
    monkeypatch.setattr(streams, "capturing", lambda device: False)
    for call in calls.values():
        call()  # outside capture every one of them runs
    pool.check()


def test_queued_copies_are_waited_for_by_a_later_call_on_another_stream():
    log: list = []
    a, b = FakeStream("a", log), FakeStream("b", log)
    current = [a]
    pool = device_path(make(), log, current)
    h = pool.open(1)
    fill(pool, pool.extend(h, 6))
    (f,) = pool.fork(int(h[0]), 1)  # state copied: recorded on a
    log.clear()
    pool.extend([f], 1)  # copy-on-write of the shared partial page, on a
    assert ("record", "a") in log
    current[0] = b
    log.clear()
    pool.open(1)
    assert log[0] == ("wait", "b"), "a hand-out from another stream did not wait for the copies"
    log.clear()
    pool.open(1)  # b already waits for the last record
    assert ("wait", "b") not in log
    pool.check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_capture_is_refused_before_the_core_changes():
    pool = make(device="cuda", max_requests=8)
    h = pool.open(2)
    pool.extend(h, [6, 9])  # warm up every kernel outside the capture
    pool.fork(int(h[0]), 1)
    torch.cuda.synchronize()
    before = (pool.lengths(h).tolist(), pool.open_requests)
    side = torch.cuda.Stream()
    for call in (lambda: pool.extend(h, 1), lambda: pool.admit([2]), lambda: pool.fork(int(h[0]), 1),
                 lambda: pool.open(1), lambda: pool.page_table(h, 1)):
        with pytest.raises(TensorDeviceError, match="being captured"):
            # A fresh graph each time: torch refuses to capture twice into one instance,
            # even after a capture that raised.
            with torch.cuda.stream(side), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=side):
                call()
        assert (pool.lengths(h).tolist(), pool.open_requests) == before
    pool.extend(h, 1)  # nothing was left half done: the pool still works
    torch.cuda.synchronize()
    pool.check()


def test_publishing_a_state_checkpoint_is_refused_during_capture(monkeypatch):
    # cache() and close(cache=True) copy the request's state into a checkpoint slot (indices
    # through the pinned ring). Inside a capture that copy is only recorded, not run: the core
    # would register a checkpoint whose slot was never written, and the ring's event would
    # poison the pool. Refused before the core changes, as open/extend are; a close that
    # publishes nothing stages nothing and still runs.
    log: list = []
    pool = device_path(make(max_requests=8), log, [FakeStream("compute", log)])
    h = pool.open(2)
    fill(pool, pool.extend(h, [8, 8], tokens=np.arange(16, dtype=np.int32)))
    state = pool._state_group(2).index

    def snapshot():
        return (pool.open_requests, pool.cached_pages(2), pool.allocator.pending_copies(state),
                [s.clone() for states in pool._states if states for s in states.values()])

    before = snapshot()
    monkeypatch.setattr(streams, "capturing", lambda device: True)
    for name, call in (("cache", lambda: pool.cache(h[:1])), ("close", lambda: pool.close(h[:1], cache=True))):
        with pytest.raises(TensorDeviceError, match="being captured") as e:
            call()
        assert name in str(e.value)
        after = snapshot()
        assert after[:3] == before[:3] and all(torch.equal(a, b) for a, b in zip(after[3], before[3])), name
    pool.close(h[1:])  # publishes nothing: no copy, allowed during capture
    monkeypatch.setattr(streams, "capturing", lambda device: False)
    pool.cache(h[:1])
    assert pool.cached_pages(2) > before[1]  # outside capture the checkpoint is published
    pool.check()
