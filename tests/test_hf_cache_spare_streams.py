"""The spares a pool keeps for its next KVPoolCache (layer buffers, staging buffers) on CUDA: a
spare given back on one stream and taken on another must make the taker's stream wait for the
work the closed cache queued, and a stream being captured into a CUDA graph takes none.

No GPU is needed for the ordering: torch.cuda's events and streams are replaced by fakes that
record what was asked of them, and the spares' tensors by stand-ins that say they are on CUDA.
The last test runs the real thing on a GPU (it skips without one)."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch

from kvpool import KVPool  # noqa: E402
from kvpool.integrations import _layer_buffers  # noqa: E402
from kvpool.integrations._layer_buffers import BufferSpares, LayerBuffers  # noqa: E402
from kvpool.integrations.transformers import KVPoolCache  # noqa: E402


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name, self.waited = name, []

    def wait_event(self, event) -> None:
        self.waited.append(event)


class FakeEvent:
    def __init__(self) -> None:
        self.on = None

    def record(self, stream) -> None:
        self.on = stream


class OnCuda:
    """What the fences read of a tensor: that it is on a CUDA device."""

    is_cuda = True
    device = torch.device("cuda", 0)


@pytest.fixture
def cuda(monkeypatch):
    # "capturing": the current stream of device "capturing_device" is being captured; torch
    # answers is_current_stream_capturing() for the current device only (torch.cuda.device).
    state = {"stream": FakeStream("a"), "capturing": False, "capturing_device": 0, "current_device": 0}

    @contextlib.contextmanager
    def device(d):
        before, state["current_device"] = state["current_device"], d if isinstance(d, int) else torch.device(d).index
        try:
            yield
        finally:
            state["current_device"] = before

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["stream"])
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current_device"])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing",
                        lambda: state["capturing"] and state["current_device"] == state["capturing_device"])
    return state


def cuda_buffers(b: int = 2, cap: int = 8) -> LayerBuffers:
    lb = LayerBuffers(torch.empty(0), 2, b, 2, cap, 4)
    lb.buf = OnCuda()  # type: ignore[assignment]  # the fences read only is_cuda and device
    return lb


def test_a_spare_taken_on_another_stream_waits_for_the_givers_work(cuda):
    spares = BufferSpares()
    lb = cuda_buffers()
    spares.give(lb)  # closed on stream a
    assert isinstance(lb.fence, FakeEvent) and lb.fence.on is cuda["stream"]
    event = lb.fence
    cuda["stream"] = taker = FakeStream("b")
    assert spares.take(2, 8, OnCuda()) is lb
    assert taker.waited == [event], "the taking stream must wait for the closed cache's work"
    assert lb.fence is None


def test_no_spare_is_taken_into_a_graph_being_captured(cuda):
    spares = BufferSpares()
    lb = cuda_buffers()
    spares.give(lb)
    cuda["capturing"] = True
    assert spares.take(2, 8, OnCuda()) is None, "a captured graph would depend on work outside it"
    assert len(spares) == 1
    cuda["capturing"] = False
    assert spares.take(2, 8, OnCuda()) is lb


class OnCuda1(OnCuda):
    device = torch.device("cuda", 1)


def test_a_capture_is_asked_of_the_tensors_device_not_the_current_one(cuda):
    # Buffers on cuda:1 while cuda:0 is current: only a capture on cuda:1 concerns them.
    lb = LayerBuffers(torch.empty(0), 2, 2, 2, 8, 4)
    lb.buf = OnCuda1()  # type: ignore[assignment]
    spares = BufferSpares()
    cuda["capturing"], cuda["capturing_device"] = True, 0  # cuda:0 (current) is capturing
    assert _layer_buffers.reusable(OnCuda1()), "a capture on another device does not concern cuda:1"
    spares.give(lb)
    assert isinstance(lb.fence, FakeEvent), "cuda:1's stream is not captured: the fence is recorded"
    cuda["capturing_device"] = 1  # now cuda:1, not the current device, is capturing
    assert not _layer_buffers.reusable(OnCuda1())
    assert _layer_buffers.stream_mark(OnCuda1()) is None
    assert spares.take(2, 8, OnCuda1()) is None, "a graph captured on cuda:1 would depend on work outside it"
    assert cuda["current_device"] == 0  # the current device is left as it was


def test_cpu_spares_touch_no_cuda_state(monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("a CPU spare asked torch.cuda for an event or a stream")

    monkeypatch.setattr(torch.cuda, "Event", no_cuda)
    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    spares = BufferSpares()
    lb = LayerBuffers(torch.empty(0), 2, 2, 2, 8, 4)
    spares.give(lb)
    assert lb.fence is None
    assert spares.take(2, 8, torch.empty(0)) is lb


def test_a_staging_spare_is_kept_with_its_fence_and_taken_after_it(cuda, monkeypatch):
    """``layer_buffers=False`` caches: the staging buffer goes back with the stream mark of its
    cache, and the next cache's stream waits on it before using it."""
    from kvpool.integrations._pool_views import pool_views

    pool = KVPool(2, 2, 4, dtype=torch.float32, page_size=2, num_slots=256, max_requests=8,
                  max_context_len=64)
    stage = torch.zeros(4096)  # room for any gather of this pool
    event = FakeEvent()
    pool_views(pool).spare_stages.append((stage, event))
    waited: list[tuple[object, object]] = []
    monkeypatch.setattr("kvpool.integrations._pages.stream_wait", lambda t, e: waited.append((t, e)))
    h = pool.open(3)  # interleaved free pages: the cache gathers into a staging buffer
    for _ in range(5):
        pool.extend(h, 1)
    pool.close(h)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode(), KVPoolCache(pool, layer_buffers=False) as cache:
        k = torch.randn(2, 2, 3, 4, generator=g)
        for layer in range(2):
            got, _ = cache.update(k, -k, layer)
            assert torch.equal(got, k)
        assert cache.requests.pages._stage is stage
    assert waited == [(stage, event)]
    kept = pool_views(pool).spare_stages
    assert len(kept) == 1 and kept[0][0] is stage
    assert _layer_buffers.stream_mark(torch.empty(0)) is None  # a CPU tensor is never marked


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_caches_on_two_streams_share_spares_correctly():
    pool = KVPool(2, 2, 8, dtype=torch.float32, page_size=4, num_slots=1024, max_requests=8,
                  max_context_len=256, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for stream in (torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()):
        with torch.cuda.stream(stream), torch.inference_mode(), KVPoolCache(pool) as cache:
            rows = [None, None]
            for t in (9, 1, 1, 1, 1, 1):
                for layer in range(2):
                    k = torch.randn(2, 2, t, 8, generator=g, device="cuda")
                    rows[layer] = k if rows[layer] is None else torch.cat([rows[layer], k], dim=2)
                    got, _ = cache.update(k, -k, layer)
                    assert torch.equal(got, rows[layer])
    torch.cuda.synchronize()


def test_a_spare_given_back_while_capturing_is_never_taken_without_a_fence(cuda):
    """A stream being captured records no event (stream_mark), so a set of buffers given back
    then (buffers outgrown inside a captured step) would carry no fence: a cache on another
    stream would write into it while the giver's earlier work may still read it."""
    spares = BufferSpares()
    lb = cuda_buffers()
    cuda["capturing"] = True
    spares.give(lb)
    cuda["capturing"] = False
    cuda["stream"] = taker = FakeStream("b")
    got = spares.take(2, 8, OnCuda())
    assert got is None or taker.waited, "a spare was taken on another stream with nothing to wait on"


def test_a_staging_buffer_released_while_capturing_is_not_kept_without_a_fence(cuda):
    from kvpool.integrations._pages import StepPages

    kept: list[tuple[object, object]] = []

    class Released:
        _stage, layer_buffers, _spares = OnCuda(), False, kept

        def reset(self, *args, **kwargs) -> None:
            pass

        def _set_buffers(self, lb) -> None:
            pass

    cuda["capturing"] = True
    StepPages.release(Released())  # type: ignore[arg-type]
    assert all(fence is not None for _, fence in kept), kept
