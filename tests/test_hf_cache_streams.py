"""KVPoolCache's deferred steps and CUDA streams and graphs, on CPU with fakes
(``test_hf_cache_deferred_cuda.py`` runs the same on a GPU):

- a flush stores the layer buffers that the steps' layers wrote on their stream; called from
  another stream (``cache.handles`` after a ``generate`` on a side stream), it makes its own
  stream wait for that one first;
- a decode step inside a page makes no pool call, and a flush inside a capture would be
  recorded rather than run: every step and flush of a CUDA pool's cache is refused while its
  device is capturing, before anything changes (as ``extend`` refuses).

The cache here is a CPU pool's told it is on CUDA (``requests.cuda``), with the stream and
capture questions answered by the test."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch

from test_hf_cache_deferred import Reference  # noqa: E402
from test_hf_cache_steps import PAGE, make_pool, scramble  # noqa: E402

from kvpool import TensorDeviceError  # noqa: E402
from kvpool.integrations import _batch_steps, _buffer_steps, _layer_buffers  # noqa: E402
from kvpool.integrations.transformers import KVPoolCache  # noqa: E402


class Streams:
    """The current stream's raw handle, whether it is capturing, and what was followed."""

    def __init__(self, monkeypatch) -> None:
        self.now, self.capturing, self.followed = 100, False, []
        monkeypatch.setattr(_batch_steps, "current_raw_stream", lambda device: self.now)
        monkeypatch.setattr(_buffer_steps, "follow_stream", lambda device, raw: self.followed.append((raw, self.now)))

        def refuse(device, what):
            if self.capturing:  # (kvpool.streams.refuse_capture's error)
                raise TensorDeviceError(f"{what} was called while a CUDA graph is being captured")

        monkeypatch.setattr(_batch_steps, "refuse_capture", refuse)


def cuda_like_cache(pool) -> KVPoolCache:
    cache = KVPoolCache(pool)
    cache.requests.cuda = True
    return cache


def test_a_flush_follows_the_stream_the_steps_ran_on(monkeypatch):
    s = Streams(monkeypatch)
    pool = make_pool()
    scramble(pool)
    ref = Reference(2)
    with torch.inference_mode(), cuda_like_cache(pool) as cache:
        s.now = 7  # the forward runs on a side stream
        ref.step(cache, 5)  # the prompt: stored from the buffers at the next flush
        s.now = 100
        ref.check_pool(pool, cache.handles)
        assert s.followed == [(7, 100)]
        s.followed.clear()
        s.now = 7
        for _ in range(PAGE + 2):  # a page boundary (a flush on the same stream), then deferred steps
            ref.step(cache, 1)
        assert s.followed and all(raw == 7 for raw, _ in s.followed)
        s.followed.clear()
        assert cache.requests.deferred == 2
        s.now = 100  # handles read on the default stream: the flush follows stream 7
        raw = cache.handles
        assert s.followed == [(7, 100)]
        ref.check_pool(pool, raw)
        s.now = 9  # the next steps on a third stream: the next flush follows that one
        for _ in range(PAGE):
            ref.step(cache, 1)
        s.followed.clear()
        s.now = 100
        cache.flush()
        assert s.followed == [(9, 100)]
        ref.check_pool(pool, cache.handles)


@pytest.mark.parametrize("where", ["deferred", "page_start"])
def test_a_step_or_flush_under_capture_is_refused_and_changes_nothing(monkeypatch, where):
    s = Streams(monkeypatch)
    pool = make_pool()
    scramble(pool)
    ref = Reference(2, seed=1)
    with torch.inference_mode(), cuda_like_cache(pool) as cache:
        ref.step(cache, 5)
        ref.step(cache, 1)
        req = cache.requests
        if where == "page_start":  # the next step needs a page: it would flush first
            while req.length % PAGE:
                ref.step(cache, 1)
            assert req.deferred == PAGE - 1
        else:  # the next step is deferred: no pool call at all
            assert req.deferred == 1 and req.pages.deferring
        before = (req.length, req.deferred, len(req.unstored), pool.allocator.lengths(req.handles).tolist(),
                  pool.free_pages)
        s.capturing = True
        k = torch.randn(2, 2, 1, 8)
        with pytest.raises(TensorDeviceError, match="being captured"):
            cache.update(k, k, 0)
        with pytest.raises(TensorDeviceError, match="being captured"):
            cache.flush()
        assert (req.length, req.deferred, len(req.unstored), pool.allocator.lengths(req.handles).tolist(),
                pool.free_pages) == before
        s.capturing = False
        for _ in range(PAGE + 1):  # and decoding goes on, every token where it belongs
            ref.step(cache, 1)
        ref.check_pool(pool, cache.handles)


def test_follow_stream_waits_only_for_another_stream(monkeypatch):
    waits = []

    class FakeStream:
        def __init__(self, raw):
            self.raw = raw

        def wait_stream(self, other):
            waits.append((self.raw, other.raw))

    now = {"raw": 5}
    monkeypatch.setattr(_layer_buffers, "current_raw_stream", lambda device: now["raw"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(now["raw"]))
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda raw, device=None: FakeStream(raw))
    dev = torch.device("cuda", 0)
    _layer_buffers.follow_stream(dev, 5)
    assert waits == []
    _layer_buffers.follow_stream(dev, 8)
    assert waits == [(5, 8)]


def test_a_first_step_under_capture_leaves_no_rows_open(monkeypatch):
    s = Streams(monkeypatch)
    pool = make_pool()
    ref = Reference(2, seed=2)
    with torch.inference_mode(), cuda_like_cache(pool) as cache:
        s.capturing = True
        k = torch.randn(2, 2, 5, 8)
        with pytest.raises(TensorDeviceError, match="being captured"):
            cache.update(k, k, 0)
        assert pool.allocator.open_requests == 0 and pool.allocator.used_pages == 0
        s.capturing = False
        ref.step(cache, 5)
        ref.step(cache, 1)
        ref.check_pool(pool, cache.handles)
    assert pool.allocator.open_requests == 0
