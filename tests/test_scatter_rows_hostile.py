"""The core's row copy (``_core.scatter_rows`` / ``rows.scatter_into``) against hostile
callers: aliasing tensors, odd geometry, torch's tracing and interception machinery.
Whatever it does not take, it declines (-1) with nothing touched, and torch stores."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import kvpool
from kvpool._core import scatter_rows
from kvpool.rows import scatter_into

# scatter_rows stores in place only through torch's DLPack C exchange API; a torch without it
# (2.4) declines every call to torch's own path, so these cases of the in-place path skip there.
NEEDS_EXCHANGE_API = pytest.mark.skipif(not hasattr(torch._C, "_dlpack_exchange_api"),
                                        reason="this torch has no DLPack C exchange API: scatter_rows declines every call")

H, D = 2, 8


def small_pool(**kw) -> kvpool.KVPool:
    return kvpool.KVPool(2, H, D, dtype=torch.float32, page_size=1, num_pages=16, max_requests=2,
                         max_context_len=8, **kw)


class OpLog(TorchDispatchMode):
    """Records the aten ops it sees (a profiler, a FLOP counter or a tracer sees the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


# ----- torch's dispatch modes see the store ---------------------------------

def test_a_dispatch_mode_sees_the_store_of_a_write():
    """A TorchDispatchMode (profilers, FlopCounterMode, DebugMode, FakeTensorMode, make_fx's
    tracer) sees every aten op; a native memcpy would store behind its back."""
    pool = small_pool()
    pool.extend(pool.open(1), 2)
    log = OpLog()
    with log:
        pool.write(0, torch.tensor([3, 4]), torch.ones(2, H, D), torch.full((2, H, D), 2.0))
    assert any("index_copy" in op for op in log.ops), log.ops
    gk, gv = pool.read(0, [3, 4])
    assert gk.eq(1).all() and gv.eq(2).all()


def test_make_fx_traces_the_store_of_a_write():
    """make_fx (and export built on it) records the write in the graph instead of running
    it once, at trace time, on the real cache."""
    pool = small_pool()
    slots = pool.extend(pool.open(1), 2).out_cache_loc  # pool-made: no data-dependent check to trace

    def step(k, v):
        pool.write(0, slots, k, v)
        return k + 1

    graph = make_fx(step)(torch.ones(2, H, D), torch.ones(2, H, D))
    assert "index_copy" in graph.code, graph.code


def test_scatter_into_declines_under_a_dispatch_mode_and_stores_nothing():
    cache = torch.zeros(4, H, D)
    with OpLog():
        assert not scatter_into((cache,), torch.tensor([1]), (torch.ones(1, H, D),))
    assert not cache.any()


def test_hybrid_write_under_a_dispatch_mode_goes_through_torch():
    pool = kvpool.KVPool(2, H, D, layer_types=["full_attention", "sliding_attention"], sliding_window=4,
                         dtype=torch.float32, page_size=4, num_pages=16, max_requests=2, max_context_len=32)
    res = pool.extend(pool.open(1), 3)
    s = res.for_layer(0)
    log = OpLog()
    with log:
        pool.write(0, s, torch.ones(3, H, D), torch.ones(3, H, D))
    assert any("index_copy" in op for op in log.ops), log.ops
    assert pool.read(0, s)[0].eq(1).all()


# ----- geometry the copy does not take ----------------------------------------

@pytest.mark.parametrize("cache,src", [
    (torch.zeros(1, 0), torch.zeros(1, 0)),
    (torch.zeros(4, 0).as_strided((4, 0), (0, 1)), torch.zeros(1, 0)),
], ids=["one empty row", "four empty rows"])
def test_rows_of_zero_bytes_are_left_to_torch(cache, src):
    """torch stores rows of no elements without complaint; the copy declines them rather
    than raise an IndexError that write would turn into a SlotRangeError."""
    assert scatter_rows((cache,), torch.tensor([0]), (src,)) == -1


def hostile_geometry():
    base = torch.zeros(64)
    yield "cache rows that overlap (stride 1 on dim 0)", (base.as_strided((4, H, D), (1, D, 1)),), \
        torch.tensor([1]), (torch.ones(1, H, D),)
    yield "cache stride 0 on dim 0", (torch.zeros(1, H, D).expand(4, H, D),), torch.tensor([1]), \
        (torch.ones(1, H, D),)
    yield "source stride 0 on dim 0", (torch.zeros(4, H, D),), torch.tensor([1, 2]), \
        (torch.ones(1, H, D).expand(2, H, D),)
    yield "a source of 2**40 expanded rows", (torch.zeros(4, H, D),), torch.zeros(2, dtype=torch.long), \
        (torch.ones(1, H, D).expand(2 ** 40, H, D),)
    yield "0-d tensors", (torch.zeros(()),), torch.tensor([0]), (torch.zeros(()),)
    yield "the same cache twice", (base[:32].view(2, H, D),) * 2, torch.tensor([1]), \
        (torch.ones(1, H, D), torch.ones(1, H, D))
    complex_cache = torch.zeros(4, H, D, dtype=torch.complex64)
    yield "a conj view of a complex cache", (complex_cache.conj(),), torch.tensor([1]), \
        (torch.ones(1, H, D, dtype=torch.complex64),)
    yield "meta tensors", (torch.zeros(4, H, D, device="meta"),), torch.tensor([1]), \
        (torch.ones(1, H, D, device="meta"),)
    yield "sparse tensors", (torch.zeros(4, H, D).to_sparse(),), torch.tensor([1]), \
        (torch.ones(1, H, D).to_sparse(),)
    yield "bool slots", (torch.zeros(4, H, D),), torch.tensor([True, False]), (torch.ones(2, H, D),)
    yield "negative-bit slots", (torch.zeros(4, H, D),), torch.tensor([1, 2])._neg_view(), \
        (torch.ones(2, H, D),)


@pytest.mark.parametrize("name,cs,idx,src", list(hostile_geometry()), ids=[c[0] for c in hostile_geometry()])
def test_hostile_geometry_is_declined_untouched(name, cs, idx, src):
    before = [c.clone() if c.layout is torch.strided and c.device.type == "cpu" else None for c in cs]
    assert scatter_rows(cs, idx, src) == -1
    for c, b in zip(cs, before):
        if b is not None:
            assert torch.equal(c, b)


# ----- aliasing the copy takes, with torch's meaning ------------------------------

@NEEDS_EXCHANGE_API
def test_slots_that_are_a_view_of_the_cache_are_read_before_any_row_is_stored():
    cache = torch.zeros(8, 2, dtype=torch.int64)
    cache[0] = torch.tensor([3, 5])
    rows = torch.tensor([[7, 7], [9, 9]])
    assert scatter_rows((cache,), cache[0], (rows,)) == 2
    assert cache[3].tolist() == [7, 7] and cache[5].tolist() == [9, 9]


@NEEDS_EXCHANGE_API
def test_a_one_row_cache_with_odd_strides_gets_exactly_its_row():
    base = torch.zeros(200)
    cache = base.as_strided((1, 1, D), (7, 999, 1), 24)
    assert scatter_rows((cache,), torch.tensor([0]), (torch.ones(1, 1, D),)) == 1
    assert base.nonzero().flatten().tolist() == list(range(24, 24 + D))


def test_a_source_in_another_layer_of_the_same_storage_is_stored_as_it_is():
    pool = small_pool()
    pool.extend(pool.open(1), 4)
    k1, v1 = pool._row_caches[1]
    k1[0:2] = torch.arange(2 * H * D, dtype=torch.float32).view(2, H, D)
    pool.write(0, torch.tensor([5, 6]), k1[0:2], k1[0:2])
    gk, gv = pool.read(0, [5, 6])
    assert torch.equal(gk, k1[0:2]) and torch.equal(gv, k1[0:2])
