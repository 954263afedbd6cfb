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
    """What the fences read of a tensor: that it is on a CUDA device; and the streams it was
    marked as used on (``record_stream``)."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self) -> None:
        self.recorded: list[object] = []

    def record_stream(self, stream) -> None:
        self.recorded.append(stream)


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
    pool_views(pool).spare_stages.append((stage, event, set()))
    waited: list[tuple[object, object]] = []
    monkeypatch.setattr("kvpool.integrations._pages.stream_wait", lambda t, e, s=None: waited.append((t, e)))
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
    assert all(fence is not None for _, fence, _ in kept), kept


def made_on_current_stream(lb: LayerBuffers) -> LayerBuffers:
    """``lb`` as if its buffers had been allocated on the current (fake) stream."""
    lb.streams = {torch.cuda.current_stream()}
    return lb


def test_a_spare_used_on_another_stream_is_marked_as_used_there(cuda):
    """torch's caching allocator reuses a freed block at once for the next tensor of the stream
    it was allocated on. A spare taken by a cache on another stream and freed later (dropped
    from the spares, outgrown, release_buffers) while that stream still has work queued on it
    would be written by that work after its memory went to another tensor: the taker's stream
    must be recorded on it (``record_stream``), once, and never on the one-stream path."""
    a = cuda["stream"]
    spares = BufferSpares()
    lb = made_on_current_stream(cuda_buffers())
    for _ in range(3):  # one stream: caches give and take it with no marking at all
        spares.give(lb)
        assert spares.take(2, 8, OnCuda()) is lb
    assert lb.buf.recorded == [], "the one-stream path marked a spare"
    spares.give(lb)
    cuda["stream"] = b = FakeStream("b")
    assert spares.take(2, 8, OnCuda()) is lb
    assert lb.buf.recorded == [b], "a spare taken on another stream was not marked as used there"
    spares.give(lb)  # given back on b, taken on a (where it was made), then on b again
    cuda["stream"] = a
    assert spares.take(2, 8, OnCuda()) is lb
    spares.give(lb)
    cuda["stream"] = b
    assert spares.take(2, 8, OnCuda()) is lb
    assert lb.buf.recorded == [b], "each stream is marked once (record_stream is sticky)"


def test_buffers_given_back_on_another_stream_than_their_own_are_marked(cuda):
    """A cache whose buffers were made on one stream and that closes on another: kept as a
    spare, they may be dropped (a fifth set, release_buffers) before the closing stream ran."""
    lb = made_on_current_stream(cuda_buffers())
    cuda["stream"] = b = FakeStream("b")
    BufferSpares().give(lb)
    assert lb.buf.recorded == [b]


class Stage(OnCuda):
    """A staging buffer with room for any gather."""

    def numel(self) -> int:
        return 1 << 20

    def __getitem__(self, key) -> Stage:
        return self


def test_a_staging_spare_used_on_another_stream_is_marked_as_used_there(cuda):
    from kvpool.integrations._pages import StepPages

    a = cuda["stream"]
    stage, kept = Stage(), []

    class Cache:
        """What ``_storage`` and ``release`` use of a ``layer_buffers=False`` cache."""

        _stage, _stage_streams, layer_buffers, _spares = None, set(), False, kept
        paged = [(OnCuda(), OnCuda())]

        def reset(self, *args, **kwargs) -> None:
            pass

        def _set_buffers(self, lb) -> None:
            pass

    kept.append((stage, FakeEvent(), {a}))  # made and given back on a
    cuda["stream"] = b = FakeStream("b")
    cache = Cache()
    assert StepPages._storage(cache, 64) is stage  # type: ignore[arg-type]
    assert len(b.waited) == 1
    assert stage.recorded == [b], "a staging spare taken on another stream was not marked as used there"
    StepPages.release(cache)  # type: ignore[arg-type]
    (entry,) = kept
    assert entry[0] is stage and entry[2] == {a, b}
    cuda["stream"] = a
    StepPages._storage(Cache(), 64)  # type: ignore[arg-type]
    assert stage.recorded == [b], "a stream already marked was marked again"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_spare_freed_while_its_takers_stream_is_busy_keeps_its_memory_until_then():
    """Real streams: a spare made on the default stream, taken on a side stream that queues a
    slow write into it, then dropped. A tensor made on the default stream right after must
    not get its memory while that write is still queued (it would overwrite it)."""
    like = torch.empty(0, device="cuda")
    spares = BufferSpares()
    lb = LayerBuffers(like, 2, 2, 2, 64, 64)
    numel, ptr = lb.buf.numel(), lb.buf.data_ptr()
    spares.give(lb)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = spares.take(2, 64, like)
        assert got is lb
        torch.cuda._sleep(200_000_000)  # (GPU cycles: a busy side stream, ~0.1 s)
        got.buf.fill_(1.0)
    del got, lb
    spares.clear()  # the spare's last reference: freed while the side stream still sleeps
    fresh = torch.zeros(numel, device="cuda")
    torch.cuda.synchronize()
    assert fresh.data_ptr() != ptr or not bool(fresh.any()), "the side stream wrote into a new tensor"
    assert not bool(fresh.any())
