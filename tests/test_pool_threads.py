"""A KVPool shared between threads never corrupts K/V.

Copy-on-write copies run inside the pool's lock, so no other thread can free
and reuse a copy's source page before the copy has read it; and whether extend
asks the core for copy-on-write work is decided under the same lock as fork and
open_with_prefix, which make pages shared. The first two tests force the bad
interleavings deterministically (a hook pauses one thread inside the pool call
and lets the other run, for as long as the pool lets it); the third runs four
threads for a few seconds and reads every request back bitwise after every step.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
import torch

import kvpool
import kvpool.sharing as sharing_module
from kvpool import PoolExhaustedError, TooManyRequestsError

# How long a paused thread gives the other one. The other thread's pool calls
# take microseconds when nothing blocks them; with the lock they wait for the
# paused call instead, and the pause ends at this bound.
WINDOW_S = 1.0


def small_pool(**kw) -> kvpool.KVPool:
    kw = {"dtype": torch.float32, "page_size": 4, "num_pages": 8, "max_requests": 8, "max_context_len": 16, **kw}
    return kvpool.KVPool(1, 1, 1, **kw)


def rows(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(-1, 1, 1)


def run_both(a, b) -> None:
    errors: list[BaseException] = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - surfaced below
                errors.append(e)
        return run

    threads = [threading.Thread(target=guarded(f)) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a thread hung"
    if errors:
        raise errors[0]


def test_copy_source_page_is_not_reused_before_the_copy_runs(monkeypatch):
    """Thread A forks a request and extends the child (copy-on-write of the shared
    last page); while A's copy is about to run, thread B closes the parent, admits
    a request (which gets the freed page back from the LIFO free stack) and writes
    into it. The child must still read the parent's values."""
    pool = small_pool()
    hs, r = pool.admit([2])
    pool.write(0, r.slots, rows([111.0, 222.0]), rows([111.0, 222.0]))
    kid = pool.fork(hs[0], 1)
    a_copying, b_asked, b_done = threading.Event(), threading.Event(), threading.Event()
    real_copy = sharing_module.copy_slots
    copier = {}

    def paused_copy(*args, **kwargs):
        if threading.current_thread() is copier.get("a"):
            a_copying.set()
            assert b_asked.wait(10)
            b_done.wait(WINDOW_S)  # B gets its chance to run here
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(sharing_module, "copy_slots", paused_copy)
    got = {}

    def thread_a():
        copier["a"] = threading.current_thread()
        pool.extend(kid, 1, tokens=[5])

    def thread_b():
        assert a_copying.wait(10)
        b_asked.set()
        pool.close(hs)
        h2, r2 = pool.admit([4])
        pool.write(0, r2.slots, rows([-5.0] * 4), rows([-5.0] * 4))
        got["b"] = (h2, r2.slots)
        b_done.set()

    run_both(thread_a, thread_b)
    k, v = pool.read(0, pool.slots(kid[0])[:2])
    assert k.view(-1).tolist() == [111.0, 222.0] and v.view(-1).tolist() == [111.0, 222.0]
    # B's request still reads its own rows, and no page has two owners.
    k2, _ = pool.read(0, got["b"][1])
    assert k2.view(-1).tolist() == [-5.0] * 4
    pool.check()


class _PausingAllocator:
    """The pool's allocator, with ``extend`` paused on the way into the core
    until another thread has had its chance (the rest is forwarded)."""

    def __init__(self, inner, before_core) -> None:
        self._inner, self._before_core = inner, before_core

    def extend(self, *args, **kwargs):
        self._before_core()
        return self._inner.extend(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_first_fork_during_an_extend_is_not_missed():
    """Thread A extends a request into its partly filled last page before anything
    was ever shared; thread B forks that request meanwhile. Either the fork comes
    first and A's extend copies the shared page, or it comes after: never an
    extend that skips the copy because it looked at the sharing state too early."""
    pool = small_pool()
    hs, r = pool.admit([2])
    pool.write(0, r.slots, rows([7.0, 8.0]), rows([7.0, 8.0]))
    a_in_core, b_asked, b_done = threading.Event(), threading.Event(), threading.Event()
    extender = {}

    def before_core():
        if threading.current_thread() is extender.get("a"):
            a_in_core.set()
            assert b_asked.wait(10)
            b_done.wait(WINDOW_S)

    pool.allocator = _PausingAllocator(pool.allocator, before_core)
    kids = {}

    def thread_a():
        extender["a"] = threading.current_thread()
        pool.extend(hs, 1)

    def thread_b():
        assert a_in_core.wait(10)
        b_asked.set()
        kids["k"] = pool.fork(hs[0], 1)
        b_done.set()

    run_both(thread_a, thread_b)
    pool.allocator = pool.allocator._inner
    pool.check()
    parent = pool.read(0, pool.slots(hs[0])[:2])[0].view(-1).tolist()
    kid = pool.read(0, pool.slots(kids["k"][0])[:2])[0].view(-1).tolist()
    assert parent == [7.0, 8.0] and kid == [7.0, 8.0]
    # Nothing was left queued for a copy nobody will run.
    assert len(pool.allocator.take_copies()[0]) == 0


# ----- four threads, a few seconds -----------------------------------------------------

THREADS = 4
SECONDS = 4.0
SWITCH_S = 1e-5


class _Req:
    """A request and the value every position must read back."""

    __slots__ = ("h", "values")

    def __init__(self, h: int, values: list[float]) -> None:
        self.h, self.values = h, values


def _stamp(thread: int, serial: int, pos: int) -> float:
    """A value unique to (thread, request serial, position), exact in float32."""
    return float(((thread * 4096 + serial % 4096) * 64 + pos) % (1 << 23)) + 0.5


class _Worker:
    def __init__(self, pool, idx: int, handoff: list, handoff_lock, stop, stats) -> None:
        self.pool, self.idx, self.handoff, self.handoff_lock = pool, idx, handoff, handoff_lock
        self.stop, self.stats = stop, stats
        self.rng = np.random.default_rng(1000 + idx)
        self.mine: list[_Req] = []
        self.serial = 0

    def _next_serial(self) -> int:
        self.serial += 1
        return self.serial

    def _write(self, req: _Req, slots: np.ndarray, serial: int) -> None:
        start = len(req.values)
        vals = [_stamp(self.idx, serial, start + i) for i in range(len(slots))]
        x = rows(vals)
        self.pool.write(0, slots, x, -x)
        req.values.extend(vals)

    def _verify(self) -> None:
        for req in self.mine:
            slots = self.pool.slots(req.h)
            assert len(slots) == len(req.values), "a request's length changed under its owner"
            if not len(slots):
                continue
            k, v = self.pool.read(0, slots)
            want = rows(req.values)
            for name, got, exp in (("K", k, want), ("V", v, -want)):
                if not torch.equal(got, exp):
                    bad = int(torch.nonzero(got.view(-1) != exp.view(-1))[0, 0])
                    raise AssertionError(f"thread {self.idx}: request {req.h:#x} position {bad} reads {name} "
                                         f"{got.view(-1)[bad].item()} instead of {exp.view(-1)[bad].item()}")
        self.stats["reads"] += 1

    def step(self) -> None:
        rng, pool = self.rng, self.pool
        op = rng.random()
        try:
            if op < 0.15 or not self.mine:
                n = int(rng.integers(1, 7))
                hs, res = pool.admit([n])
                req = _Req(int(hs[0]), [])
                self.mine.append(req)
                self._write(req, res.slots, self._next_serial())
            elif op < 0.5:
                src = self.mine[int(rng.integers(len(self.mine)))]
                kid = _Req(int(pool.fork(src.h, 1)[0]), list(src.values))
                # Hand the parent (mostly) or the child to whichever thread takes it
                # next, so the two holders of a shared page live in different threads:
                # one extends its copy while the other may close the original.
                give = src if rng.random() < 0.8 else kid
                if give is src:
                    self.mine.remove(src)
                    self.mine.append(kid)
                with self.handoff_lock:
                    self.handoff.append(give)
                self.stats["forks"] += 1
            elif op < 0.8:
                batch = [q for q in self.mine if rng.random() < 0.7] or self.mine[:1]
                counts = [int(rng.integers(1, 4)) for _ in batch]
                toks = rng.integers(0, 100, size=sum(counts))
                res = pool.extend([q.h for q in batch], counts, tokens=toks)
                at = 0
                for q, c in zip(batch, counts):
                    self._write(q, res.slots[at : at + c], self._next_serial())
                    at += c
            else:
                victim = self.mine.pop(int(rng.integers(len(self.mine))))
                pool.close([victim.h])
        except (PoolExhaustedError, TooManyRequestsError, kvpool.ContextTooLongError):
            # Atomic refusals: nothing changed. Free room for the next step.
            if self.mine:
                pool.close([self.mine.pop(0).h])
        with self.handoff_lock:
            while self.handoff and rng.random() < 0.5:
                self.mine.append(self.handoff.pop())
        # Requests near max_context_len go, so extends keep happening.
        for q in [q for q in self.mine if len(q.values) > 40]:
            self.mine.remove(q)
            pool.close([q.h])
        self._verify()


def test_four_threads_fork_extend_close_admit_write_read_back_bitwise():
    pool = kvpool.KVPool(1, 1, 1, dtype=torch.float32, page_size=4, num_pages=48, max_requests=24,
                         max_context_len=48)
    stop = threading.Event()
    handoff: list[_Req] = []
    handoff_lock = threading.Lock()
    stats = {"reads": 0, "forks": 0}
    errors: list[BaseException] = []
    workers = [_Worker(pool, i, handoff, handoff_lock, stop, stats) for i in range(THREADS)]
    barrier = threading.Barrier(THREADS)

    def run(w: _Worker) -> None:
        try:
            barrier.wait(10)
            n = 0
            while not stop.is_set() and not errors:
                w.step()
                n += 1
                if n % 50 == 0:
                    pool.check()
        except BaseException as e:  # noqa: BLE001 - surfaced in the main thread
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    # Switch threads every few microseconds rather than every 5 ms, so the GIL
    # hands over inside pool calls often (between the core call and the copies).
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_S)
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + SECONDS
        while time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a worker hung"
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
    pool.check()
    # Requests left in the handoff (and with the workers) still read back intact.
    leftover = _Worker(pool, 99, [], handoff_lock, stop, stats)
    leftover.mine = [q for w in workers for q in w.mine] + handoff
    leftover._verify()
    assert stats["forks"] > 20 and stats["reads"] > 100, stats
    pool.close([q.h for q in leftover.mine])
    assert pool.used_pages == 0 and pool.open_requests == 0
    pool.check()


# ----- transfers hold the pool while they hold pages -----------------------------------

class _FakeLink:
    """kv_transfer's link to a peer, played from ``script``: ``script[what]`` is what
    each receive gets, ``script["before_" + what]`` runs first, and every message
    sent is logged in ``script["log"]`` (in the sending thread, so inside the pool
    call that sends it)."""

    script: dict = {}

    def __init__(self, peer, group, device, timeout_s) -> None:
        self.device, self.messages = torch.device("cpu"), 0

    def _log(self, what, value):
        _FakeLink.script["log"].append((what, value))

    def send(self, t, what):
        self._log(what, t.clone())

    def post_recv(self, t, what):
        t.copy_(_FakeLink.script[what].pop(0).view(t.dtype).view(t.shape))

    def wait(self, work, what):
        pass

    def send_ints(self, values, what):
        self._log(what, np.asarray(values).copy())

    def recv_ints(self, n, what):
        hook = _FakeLink.script.get("before_" + what)
        if hook is not None:
            hook()
        self._log("got " + what, None)
        return np.asarray(_FakeLink.script[what], np.int64)


@pytest.fixture
def fake_link(monkeypatch):
    from kvpool.distributed import kv_receive, kv_transfer

    _FakeLink.script = {"log": []}
    for side in (kv_transfer, kv_receive):  # the send side, the receive side
        monkeypatch.setattr(side, "_Link", _FakeLink)
        monkeypatch.setattr(side, "comm_device", lambda group, device: torch.device("cpu"))
        # No process group here: the fake link is the transport, so the peer needs no group.
        monkeypatch.setattr(side, "check_peer", lambda peer, group, name: None)
    return _FakeLink.script


def test_send_request_keeps_the_pages_until_the_ack(fake_link):
    """While send_request waits for the receiver's reply, another thread closes the
    request and reuses its pages. That close must wait for the transfer, and the
    chunk sent must hold the request's K/V."""
    from kvpool.distributed import kv_transfer
    from kvpool.distributed import protocol as P

    pool = small_pool(num_pages=16)
    hs, r = pool.admit([6])
    x = rows([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    pool.write(0, r.slots, x, -x)
    pages = torch.from_numpy(pool.pages(hs[0]).astype(np.int64))
    want = torch.stack([c[0].view(pool.num_pages, -1)[pages] for _, c in pool._storage.tensors()])
    waiting, b_done = threading.Event(), threading.Event()

    def before_reply():
        waiting.set()
        b_done.wait(WINDOW_S)

    fake_link.update({"before_reply": before_reply, "reply": [P.OK, 0, 0, 0, 0, 0], "ack": [P.OK, 2]})

    def thread_b():
        assert waiting.wait(10)
        pool.close(hs)
        _, r2 = pool.admit([8])
        pool.write(0, r2.slots, rows([-9.0] * 8), rows([-9.0] * 8))
        fake_link["log"].append(("closed", None))
        b_done.set()

    run_both(lambda: kv_transfer.send_request(pool, int(hs[0]), 1), thread_b)
    order = [what for what, _ in fake_link["log"] if what in ("got ack", "closed")]
    assert order == ["got ack", "closed"], "the request was closed while its pages were being sent"
    chunks = [t for what, t in fake_link["log"] if what == "K/V chunk"]
    # The chunk's pages, then its closing word: chunk number 1 (kvpool.distributed.stream).
    assert len(chunks) == 1 and torch.equal(chunks[0][:-8].view(torch.float32).view(want.shape), want)
    assert chunks[0][-8:].view(torch.int64).item() == 1
    pool.check()


def test_recv_request_keeps_its_pages_until_the_ack(fake_link, monkeypatch):
    """A reset from another thread while recv_request stores the chunks waits for it:
    the pages stay the received request's until the ack is sent."""
    from kvpool.distributed import kv_transfer
    from kvpool.distributed import protocol as P
    from kvpool.distributed import stream as kv_transfer_stream

    pool = small_pool(num_pages=16)
    header = np.zeros(P.HEADER_LEN, np.int64)
    header[P.H_MAGIC], header[P.H_VERSION] = P.MAGIC, P.VERSION
    for k, v in P.shape_fields(pool).items():
        header[k] = v
    header[P.H_LENGTH], header[P.H_PAGES], header[P.H_PER_CHUNK] = 6, 2, 2
    # One chunk [caches, layers, pages, page floats]: K = 1..8, V = 9..16.
    chunk = torch.cat([torch.arange(1.0, 17.0).view(torch.uint8), torch.tensor([1]).view(torch.uint8)])
    fake_link.update({"header": header, "K/V chunk": [chunk]})  # its pages, then its closing word
    storing, b_done = threading.Event(), threading.Event()
    real_unpack = kv_transfer_stream.unpack
    got = {}

    def paused_unpack(views, chunk, pages, idx):
        storing.set()
        b_done.wait(WINDOW_S)
        real_unpack(views, chunk, pages, idx)
        got["pages"] = pages.tolist()

    monkeypatch.setattr(kv_transfer_stream, "unpack", paused_unpack)

    def thread_a():
        got["h"] = kv_transfer.recv_request(pool, 0)

    def thread_b():
        assert storing.wait(10)
        pool.reset()
        fake_link["log"].append(("reset", None))
        b_done.set()

    run_both(thread_a, thread_b)
    order = [what for what, _ in fake_link["log"] if what in ("ack", "reset")]
    assert order == ["ack", "reset"], "the pool was reset under a transfer"
    k = pool.k_buffer(0).view(pool.num_pages, -1)[torch.tensor(got["pages"])].reshape(-1)
    assert k.tolist() == [float(i) for i in range(1, 9)]
    assert not pool.is_open(got["h"]) and pool.open_requests == 0
    pool.check()
