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


def test_one_buffer_carries_each_dtype_and_grows_intact(ring_parts):
    """A buffer keeps a typed view per dtype (``_Slot.fill``): int64, int32, bool and 2-D
    arrays through the same buffer, then one larger than it (the buffer is replaced, and
    its views with it), each arriving as it was."""
    _, events, allocs, make_event, alloc = ring_parts
    ring = PinnedRing(torch.device("cpu"), alloc=alloc, make_event=make_event, min_bytes=64, max_depth=1)
    arrays = [np.arange(8, dtype=np.int64), np.arange(16, dtype=np.int32)[::-1], np.array([True, False] * 4),
              np.arange(6, dtype=np.int64).reshape(2, 3), np.arange(40, dtype=np.int64), np.arange(3, dtype=np.int32)]
    for a in arrays:
        for e in events:
            e.done = True  # the previous copy has run: the one buffer may be refilled
        got = ring.to_device(a)
        assert ring.depth == 1
        assert got.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype and got.shape == a.shape
        assert np.array_equal(got.numpy(), a)
    assert allocs == [64, 512], "one buffer, replaced once for the 320-byte array"


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


def test_pool_device_copies_go_through_its_staging(ring_parts):
    """Wiring: a pool's extend (device branch) and device page tables ship their host
    arrays through pool._to_device, which a CUDA pool sets to its PinnedRing."""
    import kvpool

    _, _, _, make_event, alloc = ring_parts
    pool = kvpool.KVPool(1, 2, 8, num_pages=16, page_size=4, max_requests=4, max_context_len=32)
    assert pool._to_device is None  # CPU pool: zero-copy table, nothing to stage
    ring = PinnedRing(torch.device("cpu"), alloc=alloc, make_event=make_event)
    staged = []

    def to_device(a):
        staged.append(a.copy())
        return ring.to_device(a)

    pool._table_np, pool._to_device = None, to_device  # what a CUDA pool runs
    h = pool.open(2)
    res = pool.extend(h, [5, 3])
    assert len(staged) == 1 and res.out_cache_loc.tolist() == res.slots.tolist()
    for hh, n in zip(h, (5, 3)):
        row = int(pool.rows([hh])[0])
        assert pool.req_to_token[row, :n].tolist() == pool.slots(hh).tolist()
    # page_table: zero copy on a CPU pool; any other device ships through to_device.
    from kvpool.tables import page_table_tensors

    pt = page_table_tensors(*pool.allocator.page_table(h), torch.device("meta"), to_device)
    assert len(staged) == 2 and pt.kv_indptr.tolist() == [0, 2, 3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_extend_and_write_do_not_wait_for_queued_gpu_work():
    """An event recorded before ~0.5 s of queued GPU work must still be pending when
    extend / page_table / write(host slots) return: none of them waited for the stream."""
    import kvpool

    pool = kvpool.KVPool(1, 2, 64, dtype=torch.float16, device="cuda", page_size=16, num_pages=64,
                         max_requests=8, max_context_len=256)
    h = pool.open(4)
    pool.extend(h, 20)
    k = torch.ones((4, 2, 64), dtype=torch.float16, device="cuda")
    calls = [lambda: pool.extend(h, 1), lambda: pool.page_table(h),
             lambda: pool.write(0, np.array([16, 17, 18, 19]), k, k)]
    for call in calls:
        call()  # warm up (kernel compiles, ring buffers)
        torch.cuda.synchronize()
        torch.cuda._sleep(10**9)
        marker = torch.cuda.Event()
        marker.record()
        call()
        assert not marker.query(), "the call waited for the GPU"
        torch.cuda.synchronize()


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad"])
def test_copies_are_normal_tensors_in_every_grad_mode(ring_parts, mode):
    """A device pool's out_cache_loc and page tables come through the ring: made under
    inference mode they were inference tensors (a CPU pool's never were), which refuse an
    engine's in-place update outside inference mode. The meta device stands in for CUDA
    (the copy makes a new tensor there, as on a GPU)."""
    _, _, _, make_event, alloc = ring_parts
    ring = PinnedRing(torch.device("meta"), alloc=alloc, make_event=make_event)
    ctx = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}[mode]
    with ctx():
        got = ring.to_device(np.arange(6, dtype=np.int64))
    assert got.device.type == "meta" and got.shape == (6,)
    assert not got.is_inference() and not got.requires_grad
    got.add_(1)  # outside inference mode, as an engine padding its copy would
