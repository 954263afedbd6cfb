"""TransferRunner: one call's offloads, loads and copy-on-write copies run in that order.

On CPU the order is checked on the data itself: a batch where the load's destination is
the offload's source page and the copy's source is the load's destination gives a
different result for any other order. The CUDA stream protocol (copy stream waits for
the caller's stream, work on the copy stream, caller waits for an event, per-layer
events when layered) is checked with fake streams and events that record every call;
the work itself still runs on CPU tensors, so data and order are both checked.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import kvpool
import kvpool.tiers.transfers as T
from kvpool.errors import DuplicateSlotError, KernelArgumentError, ReservedSlotError, SlotRangeError, TensorShapeError
from kvpool.kernels.pages import PageTransfer
from kvpool.tiers import HostStorage, TransferRunner

P = 4
LAYERS = 2


def bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


# Not named setup: pytest 7 calls a module-level setup() as a nose-style fixture, with the module.
def pool_and_host(seed=0):
    pool = kvpool.KVPool(LAYERS, 2, 8, dtype=torch.bfloat16, page_size=P, num_pages=8, max_requests=4,
                         max_context_len=64)
    host = HostStorage.for_pool(pool, host_pages=4)
    gen = torch.Generator().manual_seed(seed)
    for t in pool._storage.caches + [host.buffer]:
        bits(t).copy_(torch.randint(0, 256, (bits(t).numel(),), dtype=torch.uint8, generator=gen))
    return pool, host


def dev_page(pool, page):
    return torch.stack([c[:, page * P : (page + 1) * P] for c in pool._storage.caches])  # [C, L, P, H, D]


def slots_of(page):
    return np.arange(page * P, (page + 1) * P)


# The hazard batch: offload device page 3 -> host page 1, load host page 2 -> device page 3
# (the offload's source reused as the load's destination, as when a host hit takes the
# page just written back), copy device page 3 -> device page 4 (a copy of a just-loaded page).
OFFLOADS = (np.array([3]), np.array([1]))
LOADS = (np.array([2]), np.array([3]))
COPIES = (slots_of(3), slots_of(4))


def expect_ordered(pool, host, old_dev3, old_host2):
    assert torch.equal(bits(host.buffer[1]), bits(old_dev3)), "offload must read page 3 before the load writes it"
    assert torch.equal(bits(dev_page(pool, 3)), bits(old_host2)), "load"
    assert torch.equal(bits(dev_page(pool, 4)), bits(old_host2)), "copy must read page 3 after the load"


class FakeEvent:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def record(self, stream):
        self.log.append(f"{self.name}.record({stream.name})")

    def synchronize(self):
        self.log.append(f"{self.name}.synchronize")

    def query(self):
        return True


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(f"{self.name}.wait_stream({other.name})")

    def wait_event(self, ev):
        self.log.append(f"{self.name}.wait_event({ev.name})")


class FakeStreams:
    """Records stream and event calls; ``use`` switches what ``current`` returns."""

    def __init__(self):
        self.log = []
        self.stack = [FakeStream(self.log, "compute")]
        self.events = 0

    def current(self):
        return self.stack[-1]

    def new_stream(self):
        self.log.append("new_stream")
        return FakeStream(self.log, "copy")

    def new_event(self):
        self.events += 1
        return FakeEvent(self.log, f"e{self.events}")

    @contextlib.contextmanager
    def use(self, stream):
        self.stack.append(stream)
        try:
            yield
        finally:
            self.stack.pop()


@pytest.fixture
def traced(monkeypatch):
    """Fake streams, with every page move and copy logged with the stream it ran on."""
    fake = FakeStreams()
    run = PageTransfer.run

    def logged_run(self, layers=None):
        what = "offload" if self.to_host else "load"
        fake.log.append(f"{what}({'all' if layers is None else layers})@{fake.current().name}")
        run(self, layers)

    copy = T.copy_slots

    def logged_copy(caches, src, dst):
        fake.log.append(f"copy({len(caches)} caches)@{fake.current().name}")
        copy(caches, src, dst)

    monkeypatch.setattr(PageTransfer, "run", logged_run)
    monkeypatch.setattr(T, "copy_slots", logged_copy)
    return fake


def test_cpu_runs_offloads_then_loads_then_copies():
    pool, host = pool_and_host()
    old_dev3, old_host2 = dev_page(pool, 3).clone(), host.buffer[2].clone()
    batch = TransferRunner.for_pool(pool, host).run(OFFLOADS, LOADS, COPIES)
    expect_ordered(pool, host, old_dev3, old_host2)
    assert (batch.offloaded_pages, batch.loaded_pages, batch.copied_slots) == (1, 1, P)
    assert batch.offloaded_bytes == batch.loaded_bytes == host.page_bytes
    assert batch.event is None and batch.done()


def test_queued_on_the_copy_stream_between_two_waits(traced):
    pool, host = pool_and_host()
    old_dev3, old_host2 = dev_page(pool, 3).clone(), host.buffer[2].clone()
    runner = TransferRunner.for_pool(pool, host, streams=traced)
    batch = runner.run(OFFLOADS, LOADS, COPIES)
    expect_ordered(pool, host, old_dev3, old_host2)
    assert traced.log == [
        "new_stream",
        "copy.wait_stream(compute)",  # pages the earlier steps wrote are complete
        "offload(all)@copy", "load(all)@copy", f"copy({2 * LAYERS} caches)@copy",
        "e1.record(copy)",
        "compute.wait_event(e1)",  # the step's kernels run after the transfers
    ]
    assert batch.event.name == "e1" and batch.layer_events is None
    traced.log.clear()
    batch.wait_layer(1)  # not layered: the whole batch
    assert traced.log == ["compute.wait_event(e1)"]


def test_layered_runs_give_one_event_per_layer(traced):
    pool, host = pool_and_host()
    old_dev3, old_host2 = dev_page(pool, 3).clone(), host.buffer[2].clone()
    batch = TransferRunner.for_pool(pool, host, streams=traced).run(OFFLOADS, LOADS, COPIES, layered=True)
    expect_ordered(pool, host, old_dev3, old_host2)
    assert traced.log == [
        "new_stream", "copy.wait_stream(compute)",
        "offload(all)@copy", "e1.record(copy)", "compute.wait_event(e1)",  # fresh pages writable now
        "load(0)@copy", "copy(2 caches)@copy", "e2.record(copy)",
        "load(1)@copy", "copy(2 caches)@copy", "e3.record(copy)",
        "e4.record(copy)",  # no wait on the whole batch: the engine waits per layer
    ]
    traced.log.clear()
    batch.wait_layer(1)
    batch.wait_layer(0, stream=FakeStream(traced.log, "side"))
    batch.wait()
    assert traced.log == ["compute.wait_event(e3)", "side.wait_event(e2)", "compute.wait_event(e4)"]


def test_nothing_queued_touches_no_stream(traced):
    pool, host = pool_and_host()
    runner = TransferRunner.for_pool(pool, host, streams=traced)
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    batch = runner.run(empty, empty, empty)
    batch2 = runner.run()
    assert traced.log == [] and batch.event is None and batch2.event is None
    batch.wait()
    batch.wait_layer(0)
    runner.wait()
    assert traced.log == []


def test_the_copy_stream_is_made_once(traced):
    pool, host = pool_and_host()
    runner = TransferRunner.for_pool(pool, host, streams=traced)
    runner.run(offloads=OFFLOADS)
    runner.run(loads=LOADS)
    assert traced.log.count("new_stream") == 1
    assert traced.log[-4:] == ["copy.wait_stream(compute)", "load(all)@copy", "e2.record(copy)",
                               "compute.wait_event(e2)"]


def test_other_streams_wait_once_for_the_last_batch(traced):
    pool, host = pool_and_host()
    runner = TransferRunner.for_pool(pool, host, streams=traced)
    runner.wait()  # nothing queued yet
    runner.run(offloads=OFFLOADS)
    traced.log.clear()
    runner.wait()  # the caller already waits
    side = FakeStream(traced.log, "side")
    runner.wait(side)
    runner.wait(side)
    runner.synchronize()
    assert traced.log == ["side.wait_event(e1)", "e1.synchronize"]


BAD = [
    (dict(offloads=OFFLOADS, loads=(np.array([2]), np.array([0]))), ReservedSlotError),
    (dict(offloads=OFFLOADS, loads=LOADS, copies=(slots_of(3), np.array([16, 16, 17, 18]))), DuplicateSlotError),
    (dict(offloads=OFFLOADS, copies=(slots_of(3), slots_of(3))), DuplicateSlotError),
    (dict(offloads=OFFLOADS, copies=(slots_of(3), np.array([1, 2, 3, 99]))), SlotRangeError),
    (dict(offloads=OFFLOADS, copies=(slots_of(3), slots_of(4)[:2])), TensorShapeError),
    (dict(offloads=(np.array([3]), np.array([9])), loads=LOADS), SlotRangeError),
    (dict(offloads=[3, 1], loads=LOADS), KernelArgumentError),  # not a pair of arrays
    (dict(offloads=OFFLOADS, loads=(np.array([2]),)), KernelArgumentError),
    (dict(offloads=OFFLOADS, copies=slots_of(3)), KernelArgumentError),
    (dict(offloads=OFFLOADS, loads=LOADS, layered="yes"), KernelArgumentError),
    (dict(offloads=OFFLOADS, loads=LOADS, layered=1), KernelArgumentError),
]


@pytest.mark.parametrize("kw,err", BAD)
def test_a_bad_part_refuses_the_whole_batch_before_anything_runs(traced, kw, err):
    pool, host = pool_and_host()
    before = [bits(t).clone() for t in pool._storage.caches + [host.buffer]]
    runner = TransferRunner.for_pool(pool, host, streams=traced)
    with pytest.raises(err):
        runner.run(**kw)
    assert traced.log == []
    assert all(torch.equal(bits(t), b) for t, b in zip(pool._storage.caches + [host.buffer], before))


def test_without_host_storage_only_copies_run():
    pool, _ = pool_and_host()
    runner = TransferRunner.for_pool(pool, None)
    src = dev_page(pool, 2).clone()
    runner.run(copies=(slots_of(2), slots_of(5)))
    assert torch.equal(bits(dev_page(pool, 5)), bits(src))
    with pytest.raises(KernelArgumentError, match="no host storage"):
        runner.run(offloads=OFFLOADS)


def test_after_a_layered_run_the_caller_still_waits_for_the_whole_batch(traced):
    # The caller's stream waited only for the offloads (each layer has its own event):
    # runner.wait() from it, what the pool's next page hand-out does, must not be a no-op.
    pool, host = pool_and_host()
    runner = TransferRunner.for_pool(pool, host, streams=traced)
    runner.run(OFFLOADS, LOADS, COPIES, layered=True)
    traced.log.clear()
    runner.wait()
    runner.wait()  # once is enough
    assert traced.log == ["compute.wait_event(e4)"]


@pytest.mark.parametrize("other", [dict(page_size=2), dict(page_size=8), dict(dtype=torch.float16),
                                   dict(num_kv_heads=1), dict(num_layers=1), dict(mla=True)],
                         ids=["page2", "page8", "dtype", "heads", "layers", "mla"])
def test_for_pool_refuses_host_storage_of_another_geometry(other):
    """The device caches carry no page size, so host storage built for a pool with another
    page size passed every check and moved the wrong slots (the core's page ids name
    pages of this pool's size). for_pool knows both geometries and refuses, as a buffer."""
    pool, host = pool_and_host()
    geo = dict(num_layers=LAYERS, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, page_size=P)
    if other.pop("mla", False):
        geo.update(num_kv_heads=1, kv_lora_rank=6, qk_rope_head_dim=2)
    geo.update(other)
    src = kvpool.KVPool(geo.pop("num_layers"), geo.pop("num_kv_heads"), geo.pop("head_dim"), num_pages=8,
                        max_requests=4, max_context_len=64, **geo)
    wrong = HostStorage.for_pool(src, host_pages=4)
    err = kvpool.TensorDtypeError if "dtype" in other else TensorShapeError
    for given in (wrong, wrong.buffer):
        with pytest.raises(err, match="build the host storage for this pool"):
            TransferRunner.for_pool(pool, given)
    TransferRunner.for_pool(pool, host).run(offloads=OFFLOADS)  # its own storage still works
    assert torch.equal(bits(host.buffer[1]), bits(dev_page(pool, 3)))
