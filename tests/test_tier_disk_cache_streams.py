"""DiskCache.prefetch on a CUDA pool: its load is ordered before later page hand-outs
made from other streams (kvpool/streams.py's CopyOrder).

``prefetch`` runs on a helper thread, so its ``load_pages`` goes to that thread's
stream, and the loaded pages are published (``close(cache=True)``) at once. The
engine's next ``open_with_prefix`` hits them from its own stream and its
attention reads them: that stream must wait for the load first, or it reads
pages still being filled. On CPU the device path runs with fake streams and
events (as in tests/test_pool_streams.py); the K/V itself moves for real.
"""

from __future__ import annotations

import pytest
import torch
from test_tier_disk_cache import TOKENS, hit, make_pool, prefill

import kvpool.tiers.disk_load as disk_load
from kvpool.staging import PinnedRing
from kvpool.streams import CopyOrder
from kvpool.tiers import DiskCache, FileTier


class FakeEvent:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream=None):
        self.log.append(("record", self.name, getattr(stream, "name", None)))

    def query(self):
        return True

    def synchronize(self):
        pass


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.name))


def device_path_pool(log: list, current: list):
    """A CPU pool taking a CUDA pool's path: pinned ring and copy order over fakes,
    ``current[0]`` the calling thread's stream."""
    pool = make_pool(hash_seed=22)
    ring = PinnedRing(torch.device("cpu"), alloc=lambda n: torch.empty(n, dtype=torch.uint8),
                      make_event=lambda: FakeEvent([], "ring"))
    pool._table_np, pool._to_device = None, ring.to_device
    pool._order = CopyOrder(pool.device, make_event=lambda: FakeEvent(log, "order"),
                            current_stream=lambda: current[0])
    return pool


def test_a_prefetched_load_is_waited_for_by_the_next_hit_on_another_stream(tmp_path, monkeypatch):
    src = make_pool(hash_seed=11)
    want = prefill(src, TOKENS, seed=1)
    tier = FileTier(tmp_path, 1 << 20)
    assert DiskCache(src, tier, model="m").store_new() == 4

    log: list = []
    helper, engine = FakeStream("helper", log), FakeStream("engine", log)
    current = [helper]
    dst = device_path_pool(log, current)
    real_load = disk_load.load_pages

    def logged_load(*args, **kw):
        log.append(("load", current[0].name))
        return real_load(*args, **kw)

    monkeypatch.setattr(disk_load, "load_pages", logged_load)
    assert DiskCache(dst, tier, model="m").prefetch(TOKENS) == 4
    i = log.index(("load", "helper"))
    assert ("record", "order", "helper") in log[i:], "the load was never recorded for other streams"

    current[0] = engine
    log.clear()
    n, got = hit(dst, TOKENS)
    assert n == 16 and torch.equal(got, want[:, :16])
    assert log and log[0] == ("wait", "engine", "order"), "the hit's stream did not wait for the load"
    dst.check()
    assert dst.open_requests == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_hit_from_another_stream_reads_the_prefetched_pages(tmp_path):
    """The helper's stream s1 is held back by a long kernel, then prefetches (its load
    queued behind the kernel); the engine's stream s2 hits the pages and reads them at
    once. s2 must have been made to wait for the load."""
    src = make_pool(hash_seed=11)
    want = prefill(src, TOKENS, seed=1)
    tier = FileTier(tmp_path, 1 << 20)
    assert DiskCache(src, tier, model="m").store_new() == 4
    warm = make_pool(hash_seed=22, device="cuda")
    assert DiskCache(warm, tier, model="m").prefetch(TOKENS) == 4  # compiles the load kernel
    dst = make_pool(hash_seed=22, device="cuda")
    dc = DiskCache(dst, tier, model="m")
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the load
        assert dc.prefetch(TOKENS) == 4
    with torch.cuda.stream(s2):
        n, got = hit(dst, TOKENS)
        got = got.cpu()
    assert n == 16 and torch.equal(got, want[:, :16])
    dst.check()
