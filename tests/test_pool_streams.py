"""The stream contract of a CUDA pool (kvpool/streams.py), on CPU with fakes and on CUDA.

- Calls that stage host data through the pinned ring (extend, admit, page_table,
  fork, open_with_prefix, open_with_chain_hashes) raise ``TensorDeviceError``, the
  class ``write`` raises for host slots, while the pool's device is capturing a
  CUDA graph, before anything changes: no ring event is recorded inside the
  capture, where it would poison every later ``query()``.
- Copy-on-write copies record an event on the caller's stream; a later call that
  hands out pages from another stream makes that stream wait for it first.

On CPU the device path runs with ``_table_np`` cleared and a PinnedRing over fake
events as ``_to_device`` (what a CUDA pool runs); capture is faked by patching
``kvpool.streams.capturing``, whose own question to torch
(``torch.cuda.is_current_stream_capturing``) is tested on its own.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import kvpool
import kvpool.kernels._guard as guard
import kvpool.sharing as sharing_module
from kvpool import streams
from kvpool.errors import TensorDeviceError
from kvpool.staging import PinnedRing
from kvpool.streams import CopyOrder

CUDA = torch.cuda.is_available()


class FakeEvent:
    def __init__(self, log: list, name: str = "event") -> None:
        self.log, self.name, self.done = log, name, True

    def record(self, stream=None):
        self.done = False
        self.log.append(("record", self.name, getattr(stream, "name", None)))

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.name))


def ring_pool(log: list) -> kvpool.KVPool:
    """A CPU pool taking the device path through a pinned ring of fake events."""
    pool = kvpool.KVPool(1, 1, 2, dtype=torch.float32, page_size=4, num_pages=24, max_requests=8,
                         max_context_len=32)
    ring = PinnedRing(torch.device("cpu"), alloc=lambda n: torch.empty(n, dtype=torch.uint8),
                      make_event=lambda: FakeEvent(log, "ring"))
    pool._table_np, pool._to_device = None, ring.to_device
    return pool


def state(pool: kvpool.KVPool) -> tuple:
    pool.check()
    return (pool.free_pages, pool.used_pages, pool.open_requests, pool.used_slots, pool.cached_pages,
            pool.hit_tokens, pool.miss_tokens, pool.req_to_token.clone().numpy().tobytes())


@pytest.fixture
def capturing(monkeypatch):
    flag = {"on": False}
    monkeypatch.setattr(streams, "capturing", lambda device: flag["on"])
    return flag


def test_capturing_asks_torch_about_the_pools_cuda_device_only(monkeypatch):
    asked = []

    def is_capturing():
        asked.append(True)
        return True

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", is_capturing)
    # (on_device asks for the current CUDA device; capturing lives in the kernels layer, kernels._guard)
    monkeypatch.setattr(guard, "on_device", lambda device: contextlib.nullcontext())
    assert streams.capturing(torch.device("cuda", 0)) and len(asked) == 1
    assert not streams.capturing(torch.device("cpu")) and len(asked) == 1
    with pytest.raises(TensorDeviceError, match="extend was called while a CUDA graph is being captured"):
        streams.refuse_capture(torch.device("cuda", 0), "extend")


PROMPT = list(range(100, 112))


def test_calls_that_stage_host_data_are_refused_during_capture(capturing):
    log: list = []
    pool = ring_pool(log)
    hs, _ = pool.admit([6, 9], tokens=list(range(15)))
    h = pool.open_with_prefix(PROMPT, [12])[0]
    pool.extend(h, 12, tokens=PROMPT)
    pool.cache(h)
    hashes, tokens, salt = pool.chain_hashes(h[0])
    before, records = state(pool), len(log)
    lengths = pool.lengths(hs).tolist()
    capturing["on"] = True
    calls = {
        "extend": lambda: pool.extend(hs, 1, tokens=[1, 2]),
        "admit": lambda: pool.admit([3]),
        "page_table": lambda: pool.page_table(hs),
        "fork": lambda: pool.fork(hs[0], 2),
        "open_with_prefix": lambda: pool.open_with_prefix(PROMPT, [12]),
        "open_with_chain_hashes": lambda: pool.open_with_chain_hashes(hashes, tokens, salt),
    }
    for name, call in calls.items():
        with pytest.raises(TensorDeviceError, match="being captured") as e:
            call()
        assert name in str(e.value) and "Nothing was changed" in str(e.value)
        assert state(pool) == before, f"{name} changed the pool during capture"
        assert len(log) == records, f"{name} recorded a ring event inside the capture"
    assert pool.lengths(hs).tolist() == lengths
    # Calls that stage nothing still work during capture (a captured step may close requests).
    pool.truncate(hs[:1], 5)
    capturing["on"] = False
    for call in calls.values():
        call()  # outside capture every one of them runs
    assert len(log) > records
    pool.check()


def test_write_raises_the_same_class_for_host_slots_during_capture(capturing, monkeypatch):
    import kvpool.validate as validate

    monkeypatch.setattr(validate, "_capturing", lambda device: True)
    with pytest.raises(TensorDeviceError, match="captured"):
        validate.slots_tensor(np.array([4]), torch.device("cuda", 0), 64, 4, strict=False)


def test_cpu_pool_never_asks_about_capture(monkeypatch):
    def boom():
        raise AssertionError("capture state checked for a CPU pool")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", boom)
    pool = kvpool.KVPool(1, 1, 2, dtype=torch.float32, page_size=4, num_pages=24, max_requests=8,
                         max_context_len=32)
    hs, _ = pool.admit([3, 4])
    pool.extend(hs, 1)
    pool.fork(hs[0], 1)
    pool.page_table(hs)
    pool.open_with_prefix(PROMPT, [12])


# ----- copy-on-write copies and streams ----------------------------------------------------

class Streams:
    """Fake current stream: the test switches it, CopyOrder asks for it."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.s1, self.s2, self.s3 = (FakeStream(n, log) for n in ("s1", "s2", "s3"))
        self.current = self.s1


def test_copy_order_waits_only_on_other_streams():
    log: list = []
    st = Streams(log)
    order = CopyOrder(torch.device("cpu"), make_event=lambda: FakeEvent(log, "cow"), current_stream=lambda: st.current)
    order.wait()
    assert log == []  # no copy yet: nothing to wait for
    order.copied()
    assert log == [("record", "cow", "s1")]
    order.wait()  # same stream: already ordered
    st.current = st.s2
    order.wait()
    order.wait()  # once per record and stream
    assert log[1:] == [("wait", "s2", "cow")]
    order.copied()  # s2 waited, so this record also covers s1's copies
    st.current = st.s1
    order.wait()
    st.current = st.s3
    order.wait()
    assert log[2:] == [("record", "cow", "s2"), ("wait", "s1", "cow"), ("wait", "s3", "cow")]


def test_pool_records_after_its_copies_and_hand_outs_on_other_streams_wait(capturing, monkeypatch):
    log: list = []
    st = Streams(log)
    pool = ring_pool(log)
    pool._order = CopyOrder(torch.device("cpu"), make_event=lambda: FakeEvent(log, "cow"),
                            current_stream=lambda: st.current)
    real_copy = sharing_module.copy_slots

    def logged_copy(*args, **kwargs):
        log.append(("copy",))
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(sharing_module, "copy_slots", logged_copy)
    hs, r = pool.admit([2, 3])
    pool.write(0, r.slots, torch.arange(10.0).view(5, 1, 2), torch.arange(10.0).view(5, 1, 2))
    kid = pool.fork(hs[0], 1)
    assert not [e for e in log if e[0] in ("copy", "wait") or e[1] == "cow"]
    del log[:]
    pool.extend(kid, 1, tokens=[9])  # the shared, partly filled page is copied
    cow = [e for e in log if e[0] == "copy" or e[1] == "cow"]
    assert cow == [("copy",), ("record", "cow", "s1")], "the event must be recorded after the copies"
    for name, call in (("admit", lambda: pool.admit([1])), ("extend", lambda: pool.extend(hs[1:], 1)),
                       ("fork", lambda: pool.fork(hs[1], 1)),
                       ("open_with_prefix", lambda: pool.open_with_prefix(PROMPT, [12]))):
        st.current = st.s2 if name != "extend" else st.s3
        del log[:]
        call()
        waits = [e for e in log if e[0] == "wait"]
        if name in ("admit", "extend"):
            assert waits == [("wait", st.current.name, "cow")], name
        else:
            assert waits == [], f"{name}: this stream already waited for the last copies"
    # The copy itself kept the parent's values.
    got = pool.read(0, pool.slots(kid[0])[:2])[0]
    assert got.view(-1).tolist() == [0.0, 1.0, 2.0, 3.0]


# ----- on a GPU --------------------------------------------------------------------------------

def cuda_pool() -> kvpool.KVPool:
    return kvpool.KVPool(1, 2, 64, dtype=torch.float16, device="cuda", page_size=16, num_pages=32,
                         max_requests=8, max_context_len=128)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_capture_is_refused_and_does_not_poison_the_pool():
    pool = cuda_pool()
    hs, r = pool.admit([20, 5])
    kid = pool.fork(hs[0], 1)
    pool.extend(kid, 1, tokens=[3])  # warm up every kernel and the ring
    pool.page_table(hs)
    torch.cuda.synchronize()
    before = (pool.free_pages, pool.open_requests, pool.lengths(hs).tolist())
    side = torch.cuda.Stream()
    for call in (lambda: pool.extend(hs, 1), lambda: pool.admit([2]), lambda: pool.page_table(hs),
                 lambda: pool.fork(hs[0], 1), lambda: pool.open_with_prefix(PROMPT, [12])):
        with pytest.raises(TensorDeviceError, match="being captured"):
            # A fresh graph each time: torch refuses to capture twice into one instance,
            # even after a capture that raised.
            with torch.cuda.stream(side), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=side):
                call()
        assert (pool.free_pages, pool.open_requests, pool.lengths(hs).tolist()) == before
    # The ring's events were never recorded inside a capture: later calls still work.
    for _ in range(3):
        pool.extend(hs, 1)
        pool.page_table(hs)
    torch.cuda.synchronize()
    pool.check()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_copy_on_write_is_ordered_before_a_write_from_another_stream():
    """Stream s1 is held back by a long kernel, then extends the child (copy-on-write
    of the parent's page, queued behind the kernel). Stream s2 closes the parent,
    admits a request that gets the page back, and writes into it at once. The copy
    must still read the parent's values: s2 was made to wait for it."""
    pool = cuda_pool()
    hs, r = pool.admit([20])
    x = torch.arange(20 * 2 * 64, dtype=torch.float16, device="cuda").view(20, 2, 64) % 1000
    pool.write(0, r.out_cache_loc, x, x)
    kid = pool.fork(hs[0], 1)
    warm = pool.fork(hs[0], 1)
    pool.extend(warm, 1, tokens=[1])  # compile the copy kernel before the timed part
    pool.close(warm)
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the copy
        pool.extend(kid, 1, tokens=[7])
    with torch.cuda.stream(s2):
        pool.close(hs)
        h2, r2 = pool.admit([32])
        junk = torch.full((32, 2, 64), -5.0, dtype=torch.float16, device="cuda")
        pool.write(0, r2.out_cache_loc, junk, junk)
    torch.cuda.synchronize()
    k, v = pool.read(0, pool.slots(kid[0])[:20])
    assert torch.equal(k, x) and torch.equal(v, x)
    pool.check()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_ring_records_each_copy_on_the_stream_current_at_the_copy():
    """The ring keeps the current stream's object while that stream stays current; a copy made
    on another stream must record its event there, or the ring could hand its pinned buffer to
    the next copy while this one has yet to read it."""
    dev = torch.device("cuda", torch.cuda.current_device())
    ring = PinnedRing(dev, max_depth=2)
    host = np.arange(8, dtype=np.int64)
    first = ring.to_device(host)
    torch.cuda.synchronize()
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the copy
        held = ring.to_device(host + 1)
        assert ring._stream == side
    # Recorded behind the sleep on `side`: that buffer is still busy, so the next copies
    # take the other one, and a third must wait for `side` rather than overwrite it.
    busy = [s for s in ring._slots if s.busy and not s.event.query()]
    assert len(busy) == 1
    later = ring.to_device(host + 2)
    assert ring._stream == torch.cuda.current_stream(dev)
    again = ring.to_device(host + 3)
    torch.cuda.synchronize()
    assert first.tolist() == host.tolist() and held.tolist() == (host + 1).tolist()
    assert later.tolist() == (host + 2).tolist() and again.tolist() == (host + 3).tolist()


def test_copy_order_makes_a_stream_object_only_for_a_stream_that_must_wait(monkeypatch):
    """CopyOrder.wait runs at every extend once a copy was made: streams are told apart by
    their raw handles, and ``torch.cuda.current_stream`` (a new Stream object at every call,
    ~4 µs of host time) is asked only to record and for a stream that must wait. It was asked
    at every wait."""
    import kvpool.streams as streams_module

    log: list = []
    st = Streams(log)
    made: list = []

    def current_stream(device):
        made.append(st.current.name)
        return st.current

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(streams_module, "current_raw_stream", lambda device: hash(st.current.name))
    order = CopyOrder(torch.device("cuda", 0), make_event=lambda: FakeEvent(log, "cow"))
    order.wait()
    order.copied()
    for _ in range(5):
        order.wait()  # the recording stream: nothing to wait for
    st.current = st.s2
    for _ in range(5):
        order.wait()  # waits once
    assert made == ["s1", "s2"]
    assert log == [("record", "cow", "s1"), ("wait", "s2", "cow")]
