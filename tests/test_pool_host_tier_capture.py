"""A CUDA pool with a host tier, called while its stream is capturing a CUDA graph.

The calls that stage nothing may run inside a capture (a captured step may close
requests), but on a pool with a host tier some of them queue transfers: ``cache``
and ``close(cache=True)`` under write_through, ``evict`` under write_back. Run
there, the transfers' copy stream would join the capture (the offloads recorded
into the graph, to be replayed on stale page ids) and the pinned ring's event
would be recorded inside it, poisoning every later query. So those calls are
refused with ``TensorDeviceError`` before the core changes anything; the same
calls that queue nothing still run. On CPU the device path runs with a pinned
ring over fake events and capture faked by patching ``kvpool.streams.capturing``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_pool_host_tier import PS, make, nothing_queued, serve

from kvpool import streams
from kvpool.errors import TensorDeviceError
from kvpool.staging import PinnedRing


class FakeEvent:
    def record(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


def device_path(pool):
    ring = PinnedRing(torch.device("cpu"), alloc=lambda n: torch.empty(n, dtype=torch.uint8), make_event=FakeEvent)
    pool._table_np, pool._to_device = None, ring.to_device
    return pool


def state(pool) -> tuple:
    pool.check()
    return (pool.free_pages, pool.cached_pages, pool.open_requests, pool.offload_bytes, pool.load_bytes,
            pool.host.buffer.clone().view(torch.uint8).numpy().tobytes())


@pytest.fixture
def capturing(monkeypatch):
    flag = {"on": False}
    monkeypatch.setattr(streams, "capturing", lambda device: flag["on"])
    return flag


def test_write_through_publishing_is_refused_during_capture(capturing):
    pool = device_path(make(policy="write_through"))
    h, _ = serve(pool, list(range(1000, 1009)))
    before = state(pool)
    capturing["on"] = True
    for name, call in (("cache", lambda: pool.cache([h])), ("close", lambda: pool.close([h], cache=True))):
        with pytest.raises(TensorDeviceError, match="being captured") as e:
            call()
        assert name in str(e.value)
        assert state(pool) == before, f"{name} changed the pool during capture"
        nothing_queued(pool)
    pool.evict(1)  # write_through evictions move nothing: allowed
    pool.close([h])  # and so is a close that publishes nothing
    nothing_queued(pool)
    capturing["on"] = False
    pool.check()


def test_write_back_eviction_is_refused_during_capture(capturing):
    pool = device_path(make(policy="write_back"))
    h, _ = serve(pool, list(range(1000, 1009)))
    pool.close([h], cache=True)
    assert pool.cached_pages == 2
    h2, _ = serve(pool, list(range(2000, 2000 + 2 * PS)))
    before = state(pool)
    capturing["on"] = True
    with pytest.raises(TensorDeviceError, match="evict was called while a CUDA graph is being captured"):
        pool.evict(2)
    assert state(pool) == before
    nothing_queued(pool)
    pool.cache([h2])  # write_back publishing moves nothing: allowed
    pool.close(np.array([h2]), cache=True)
    nothing_queued(pool)
    capturing["on"] = False
    assert pool.evict(2) == 2 and pool.offload_bytes == 2 * pool.host.page_bytes
    pool.check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_cuda_capture_is_refused_and_queues_nothing(policy):
    pool = make(policy=policy, device="cuda")
    prompt = list(range(1000, 1009))
    h, _ = pool.open_with_prefix(prompt, [len(prompt)])
    pool.extend(h, len(prompt), tokens=prompt)
    if policy == "write_back":
        pool.close(h, cache=True)
        calls = {"evict": lambda: pool.evict(2)}
    else:
        calls = {"cache": lambda: pool.cache(h), "close": lambda: pool.close(h, cache=True)}
    torch.cuda.synchronize()
    before = (pool.free_pages, pool.cached_pages, pool.open_requests, pool.offload_bytes)
    side = torch.cuda.Stream()
    for name, call in calls.items():
        with pytest.raises(TensorDeviceError, match=f"{name} was called while a CUDA graph is being captured"):
            # A fresh graph each time: torch refuses to capture twice into one instance,
            # even after a capture that raised.
            with torch.cuda.stream(side), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=side):
                call()
        assert (pool.free_pages, pool.cached_pages, pool.open_requests, pool.offload_bytes) == before
        nothing_queued(pool)
    for call in calls.values():  # outside capture they run, and the ring was never poisoned
        call()
    pool.extend(pool.open(1), 4)
    torch.cuda.synchronize()
    pool.check()
