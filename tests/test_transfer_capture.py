"""Page transfers called directly (``TransferRunner.run``, ``offload_pages`` / ``load_pages``) while
the caller's CUDA stream is capturing a graph are refused, typed, before anything is queued.

The pool's own calls already refused (kvpool/streams.py), but the public transfer API did not: on
CUDA the copy stream joined the capture, the host page ids' copy from a pinned buffer (freed, or a
ring slot refilled, once it has run) was recorded into the graph, and a ring's event recorded
inside the capture poisons every later query. On CPU nothing is captured, so the refusal is
checked with ``kvpool.kernels.pages.capturing`` patched (as tests/test_pool_streams.py patches
``kvpool.streams.capturing``) and, for the runner, fake streams that record every call (nothing may be called).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import kvpool
import kvpool.kernels.pages as pages_module
from kvpool.errors import TensorDeviceError
from kvpool.kernels import load_pages, offload_pages
from kvpool.tiers import HostStorage, TransferRunner

P = 4


def pool_and_host():
    pool = kvpool.KVPool(2, 2, 8, dtype=torch.float32, page_size=P, num_pages=8, max_requests=4,
                         max_context_len=64)
    host = HostStorage.for_pool(pool, host_pages=4)
    for i, t in enumerate(pool._storage.caches + [host.buffer]):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + 1000 * i)
    return pool, host


class Streams:
    """Fake stream operations: records each call (and the capture the test says is on)."""

    def __init__(self):
        self.log = []

    def current(self):
        self.log.append("current")
        return self

    def new_stream(self):
        self.log.append("new_stream")
        return self

    def new_event(self):
        self.log.append("new_event")
        return self

    def use(self, stream):
        self.log.append("use")
        return contextlib.nullcontext()

    def wait_stream(self, other):
        self.log.append("wait_stream")

    def wait_event(self, event):
        self.log.append("wait_event")

    def record(self, stream=None):
        self.log.append("record")


@pytest.fixture
def capturing(monkeypatch):
    monkeypatch.setattr(pages_module, "capturing", lambda device: True)


def snapshot(pool, host):
    return [t.clone() for t in pool._storage.caches + [host.buffer]]


def unchanged(pool, host, before):
    return all(torch.equal(a, b) for a, b in zip(pool._storage.caches + [host.buffer], before))


def test_runner_refuses_to_queue_into_a_capture(capturing):
    pool, host = pool_and_host()
    fake = Streams()
    runner = TransferRunner.for_pool(pool, host, streams=fake)
    before = snapshot(pool, host)
    with pytest.raises(TensorDeviceError, match="TransferRunner.run .*captured"):
        runner.run(offloads=(np.array([3]), np.array([1])), loads=(np.array([2]), np.array([5])))
    assert fake.log == [], "a stream or event was touched before the refusal"
    assert unchanged(pool, host, before)


def test_runner_queues_outside_a_capture():
    """The refusal asks about the capture only: the same call queues when none is under way."""
    pool, host = pool_and_host()
    fake = Streams()
    runner = TransferRunner.for_pool(pool, host, streams=fake)
    batch = runner.run(offloads=(np.array([3]), np.array([1])))
    assert batch.offloaded_pages == 1 and "new_stream" in fake.log
    torch.testing.assert_close(host.buffer[1, 0], pool._storage.caches[0][:, 3 * P:4 * P])


@pytest.mark.parametrize("what", ["offload", "load"])
def test_page_moves_refuse_to_stage_ids_into_a_capture(capturing, what):
    pool, host = pool_and_host()
    before = snapshot(pool, host)
    with pytest.raises(TensorDeviceError, match="load_pages .*captured"):
        if what == "offload":
            offload_pages(pool._storage.caches, host, [3], [1])
        else:
            load_pages(host, pool._storage.caches, [1], [3])
    assert unchanged(pool, host, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_transfers_are_refused_inside_a_real_capture():
    pool = kvpool.KVPool(2, 2, 8, dtype=torch.bfloat16, device="cuda", page_size=P, num_pages=8,
                         max_requests=4, max_context_len=64)
    host = HostStorage.for_pool(pool, host_pages=4)
    runner = TransferRunner.for_pool(pool, host)
    runner.run(offloads=(np.array([3]), np.array([1])))  # warm up (kernel compiled, ring buffers)
    torch.cuda.synchronize()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=side):
        with pytest.raises(TensorDeviceError):
            runner.run(offloads=(np.array([3]), np.array([2])))
        with pytest.raises(TensorDeviceError):
            offload_pages(pool._storage.caches, host, [3], [2])
    runner.run(offloads=(np.array([4]), np.array([2])))  # the ring was not poisoned
    torch.cuda.synchronize()


class Named:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(f"{self.name}.wait_stream")

    def wait_event(self, event):
        self.log.append(f"{self.name}.wait_event")

    def record(self, stream=None):
        self.log.append("record")


class KeyedStreams:
    """Fake streams that tell the current stream apart without making its object, as
    ``CudaStreams.key`` does with the raw handle; records the stream objects made."""

    def __init__(self):
        self.log, self.now, self.made = [], "compute", []

    def current(self):
        self.made.append(self.now)
        return Named(self.log, self.now)

    def key(self, stream=None):
        return self.now if stream is None else stream.name

    def new_stream(self):
        return Named(self.log, "copy")

    def new_event(self):
        return Named(self.log, "event")

    def use(self, stream):
        return contextlib.nullcontext()


def test_runner_wait_makes_a_stream_object_only_for_a_stream_that_must_wait():
    """``TransferRunner.wait`` runs at every extend of a pool with a host tier once a transfer was
    queued; it asked ``current()`` (on CUDA a new Stream object, ~4 µs) at every call."""
    pool, host = pool_and_host()
    fake = KeyedStreams()
    runner = TransferRunner.for_pool(pool, host, streams=fake)
    runner.run(offloads=(np.array([3]), np.array([1])))
    fake.made.clear()
    for _ in range(5):
        runner.wait()  # the caller's stream already waits for the batch
    assert fake.made == []
    fake.now = "other"
    for _ in range(5):
        runner.wait()
    assert fake.made == ["other"] and fake.log.count("other.wait_event") == 1


def test_cuda_streams_key_is_the_raw_handle(monkeypatch):
    import kvpool.tiers.transfers as T

    monkeypatch.setattr(T, "current_raw_stream", lambda device: 1234)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: pytest.fail("made a Stream object"))
    streams = T.CudaStreams(torch.device("cuda", 0))
    assert streams.key() == 1234

    class Raw:
        cuda_stream = 99

    assert streams.key(Raw()) == 99
