"""The bad-input table, continued past the allocator and the pool: the helpers and
classes of ``kvpool``'s public modules (handles, the graph runner, the router, event
publishers, metrics, tiers, kvpool.distributed, the transformers cache).

Each case asserts the exact exception class (a KVPoolError subclass, never a
TypeError / ValueError / AttributeError / MemoryError from numpy, torch or the
standard library) and a message that names the argument; calls on a live object
also check that the object is unchanged.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import kvpool
from kvpool import (
    InvalidArgumentError,
    KVPoolError,
    PublisherClosedError,
    ReservedSlotError,
    SlotRangeError,
    TensorDtypeError,
    TensorShapeError,
)
from kvpool.cuda_graph import DecodeGraphRunner, default_buckets
from kvpool.distributed import contiguous_runs, page_descriptors, shard_kv_heads, tp_pool
from kvpool.hybrid import HybridKVPool
from kvpool.tiers import FileTier, HostStorage, host_page_bytes, host_pages_for_bytes, page_key, tier_seed

RAGGED = [[1], [2, 3]]


def small_pool(**kw: Any) -> kvpool.KVPool:
    return kvpool.KVPool(2, 2, 4, num_pages=8, page_size=2, max_requests=3, max_context_len=8, **kw)


def host(**kw: Any) -> HostStorage:
    args = dict(num_layers=2, page_size=2, heads=2, head_dim=4, dtype=torch.float16) | kw
    return HostStorage(4, **args)


def runner(**kw: Any) -> DecodeGraphRunner:
    return DecodeGraphRunner(small_pool(), lambda *a: None, **({"max_batch_size": 4} | kw))


def router() -> Any:
    from kvpool.router import Router

    return Router(2, page_size=2, hash_seed=1)


FUNCTION_CASES: list[tuple[str, type, str, Callable[[], Any]]] = [
    ("handle_row('7')", InvalidArgumentError, "handle", lambda: kvpool.handle_row("7")),
    ("handle_row(1.5)", InvalidArgumentError, "handle", lambda: kvpool.handle_row(1.5)),
    ("handle_row(-1)", InvalidArgumentError, "handle", lambda: kvpool.handle_row(-1)),
    ("handle_row(2**64)", InvalidArgumentError, "handle", lambda: kvpool.handle_row(2**64)),
    ("handle_row(array)", InvalidArgumentError, "handle", lambda: kvpool.handle_row(np.array([1, 2]))),
    ("default_buckets('8')", InvalidArgumentError, "max_batch_size", lambda: default_buckets("8")),
    ("default_buckets(2**21)", InvalidArgumentError, "max_batch_size", lambda: default_buckets(2**21)),
    ("runner max_batch_size=2**21", InvalidArgumentError, "max_batch_size", lambda: runner(max_batch_size=2**21)),
    ("runner buckets=[2**21]", InvalidArgumentError, "buckets", lambda: runner(buckets=[4, 2**21])),
    ("runner enable_graphs=array", InvalidArgumentError, "enable_graphs",
     lambda: runner(enable_graphs=np.array([True, False]))),
    ("runner copy_outputs=tensor", InvalidArgumentError, "copy_outputs",
     lambda: runner(copy_outputs=torch.tensor([True, False]))),
    ("runner pad_seq_len=2**63", InvalidArgumentError, "pad_seq_len", lambda: runner(pad_seq_len=2**63)),
    ("KVPool(2**62 layers)", InvalidArgumentError, "2**63",
     lambda: kvpool.KVPool(2**62, 2, 4, num_pages=8, page_size=2)),
    ("KVPool(head_dim=2**62)", InvalidArgumentError, "head_dim",
     lambda: kvpool.KVPool(2, 2, 2**62, num_pages=8, page_size=2)),
    ("KVPool(device=2**63)", InvalidArgumentError, "device", lambda: small_pool(device=2**63)),
    ("KVPool(layout=array)", InvalidArgumentError, "layout", lambda: small_pool(layout=np.array(["token", "paged"]))),
    ("KVPool(compute_dtype=array)", InvalidArgumentError, "compute_dtype",
     lambda: small_pool(compute_dtype=np.zeros(2))),
    ("hybrid layer_types=[[...]]", InvalidArgumentError, "layer_types",
     lambda: HybridKVPool(2, 2, 4, num_pages=16, layer_types=[["full_attention"], "full_attention"])),
    ("hybrid group_pages=5", InvalidArgumentError, "group_pages",
     lambda: HybridKVPool(2, 2, 4, num_pages=16, layer_types=["full_attention"] * 2, group_pages=5)),
    ("hybrid state_shapes=array", InvalidArgumentError, "state_shapes",
     lambda: HybridKVPool(2, 2, 4, num_pages=16, layer_types=["full_attention"] * 2, state_shapes=np.ones(3))),
    ("hybrid dtype=array", InvalidArgumentError, "dtype",
     lambda: HybridKVPool(2, 2, 4, num_pages=16, layer_types=["full_attention"] * 2, dtype=np.zeros(2))),
    ("HostStorage(heads=array)", InvalidArgumentError, "heads", lambda: host(heads=np.array([1, 2]))),
    ("HostStorage(num_layers=2**62)", InvalidArgumentError, "2**63", lambda: host(num_layers=2**62)),
    ("HostStorage(dtype=array)", InvalidArgumentError, "dtype", lambda: host(dtype=np.zeros(2))),
    ("HostStorage(mla=array)", InvalidArgumentError, "mla", lambda: host(mla=np.zeros(2))),
    ("HostStorage(device=2**63)", InvalidArgumentError, "device", lambda: host(device=2**63)),
    ("host_page_bytes(mla=array)", InvalidArgumentError, "mla",
     lambda: host_page_bytes(2, 2, 2, 4, torch.float16, mla=np.zeros(2))),
    ("host_pages_for_bytes(page_bytes='x')", InvalidArgumentError, "page_bytes",
     lambda: host_pages_for_bytes(1 << 20, "x")),
    ("page_key('1', 2)", InvalidArgumentError, "hi", lambda: page_key("1", 2)),
    ("page_key(1, -1)", InvalidArgumentError, "lo", lambda: page_key(1, -1)),
    ("tier_seed('abc')", InvalidArgumentError, "fingerprint", lambda: tier_seed("abc")),
    ("tier_seed(5 bytes)", InvalidArgumentError, "fingerprint", lambda: tier_seed(b"short")),
    ("FileTier(path=5)", InvalidArgumentError, "path", lambda: FileTier(5, 1 << 20)),
    ("FileTier.get('x')", InvalidArgumentError, "page_hash", lambda: FileTier(tempfile.mkdtemp(), 1 << 20).get("x")),
    ("FileTier.get(1.5)", InvalidArgumentError, "page_hash", lambda: FileTier(tempfile.mkdtemp(), 1 << 20).get(1.5)),
    ("FileTier.put(None)", InvalidArgumentError, "PageRecord",
     lambda: FileTier(tempfile.mkdtemp(), 1 << 20).put(None)),
    ("contiguous_runs(ragged)", TensorShapeError, "pages", lambda: contiguous_runs(RAGGED)),
    ("contiguous_runs([1.5])", TensorDtypeError, "pages", lambda: contiguous_runs([1.5])),
    ("contiguous_runs([2**64])", TensorDtypeError, "pages", lambda: contiguous_runs([2**64])),
    ("page_descriptors(past the pool)", SlotRangeError, "[1, 8)", lambda: page_descriptors(small_pool(), [1, 100])),
    ("page_descriptors(negative)", SlotRangeError, "[1, 8)",
     lambda: page_descriptors(small_pool(), [-3], merge=False)),
    ("page_descriptors(page 0)", ReservedSlotError, "page 0", lambda: page_descriptors(small_pool(), [0])),
    ("page_descriptors(merge=array)", InvalidArgumentError, "merge",
     lambda: page_descriptors(small_pool(), [1], merge=np.zeros(2))),
    ("shard_kv_heads(mla=array)", InvalidArgumentError, "mla",
     lambda: shard_kv_heads(4, 0, 2, mla=np.array([True, False]))),
    ("tp_pool(seed='x')", InvalidArgumentError, "seed", lambda: tp_pool(2, 2, 4, num_pages=8, seed="x")),
    ("tp_pool(seed=2**64)", InvalidArgumentError, "seed", lambda: tp_pool(2, 2, 4, num_pages=8, seed=2**64)),
    # every seed keyword given, so seed= is not used: a typo is still refused, not ignored
    ("tp_pool(seed='x', every seed given)", InvalidArgumentError, "seed",
     lambda: tp_pool(2, 2, 4, num_pages=8, hash_seed=1, handle_seed=2, seed="x")),
    ("mutable(5)", InvalidArgumentError, "torch.Tensor or nn.Module", lambda: kvpool.mutable(5)),
]


@pytest.mark.parametrize("name,exc,names,call", FUNCTION_CASES, ids=[c[0] for c in FUNCTION_CASES])
def test_public_helper_bad_input(name, exc, names, call):
    with pytest.raises(KVPoolError) as info:
        call()
    assert type(info.value) is exc, f"{name}: {type(info.value).__name__}: {info.value}"
    assert names in str(info.value), f"{name}: the message does not name {names!r}: {info.value}"


def test_handle_row_still_takes_numpy_handles():
    a = kvpool.SlotAllocator(8, max_requests=4)
    h = a.open(2)
    assert [kvpool.handle_row(x) for x in h] == [0, 1]
    assert kvpool.handle_row(int(h[1])) == 1


def test_host_pin_without_cuda_is_named():
    if torch.cuda.is_available():
        pytest.skip("pin=True works here: the case is a machine without CUDA")
    with pytest.raises(InvalidArgumentError, match="pin=True"):
        host(pin=True)


def raw(pool: kvpool.KVPool) -> tuple:
    return (pool.free_pages, pool.open_requests) + tuple(
        t.detach().contiguous().view(torch.uint8).clone().numpy().tobytes() for _, t in pool.named_tensors())


@pytest.mark.parametrize("call", [
    lambda p: p.read(0, RAGGED),
    lambda p: p.write(0, RAGGED, torch.zeros(2, 2, 4).half(), torch.zeros(2, 2, 4).half()),
], ids=["read", "write"])
def test_ragged_slots_are_a_shape_error_and_change_nothing(call):
    pool = small_pool()
    h = pool.open(1)
    k = torch.randn(3, 2, 4).half()
    pool.write(0, pool.extend(h, 3).slots, k, -k)
    before = raw(pool)
    with pytest.raises(TensorShapeError, match="slots"):
        call(pool)
    assert raw(pool) == before


def router_state(r: Any) -> tuple:
    return (dict(r.index.where), [set(s) for s in r.index.held], list(r.load),
            [(s.next_seq, dict(s.pending)) for s in r.streams])


def fed_router() -> Any:
    from kvpool.events import LocalEventPublisher

    pytest.importorskip("msgspec")
    pool = small_pool(hash_seed=1)
    pub = LocalEventPublisher(pool)
    h, _ = pool.open_with_prefix(np.arange(6, dtype=np.int32), [6])
    pool.extend(h, 6)
    pool.cache(h)
    pub.publish()
    r = router()
    r.feed_many(0, pub.drain())
    assert r.pages(0) > 0
    return r


ROUTER_CASES: list[tuple[str, str, Callable[[Any], Any]]] = [
    ("forget('x')", "pool", lambda r: r.forget("x")),
    ("forget(-1)", "pool", lambda r: r.forget(-1)),
    ("forget(5)", "pool", lambda r: r.forget(5)),
    ("route(loads=5)", "loads", lambda r: r.route([1, 2, 3, 4, 5], loads=5)),
    ("route(loads=[1, 'x'])", "loads[1]", lambda r: r.route([1, 2, 3, 4, 5], loads=[1, "x"])),
    ("route(loads=[1, nan])", "loads[1]", lambda r: r.route([1, 2, 3, 4, 5], loads=[1, float("nan")])),
    ("route(eligible=tensor)", "eligible", lambda r: r.route([1, 2, 3, 4, 5], eligible=torch.ones(2, 2))),
    ("route(eligible=[1, 0])", "eligible[0]", lambda r: r.route([1, 2, 3, 4, 5], eligible=[1, 0])),
    ("route(ragged tokens)", "tokens", lambda r: r.route(RAGGED)),
    ("match(ragged tokens)", "tokens", lambda r: r.match(RAGGED)),
    ("feed_many(0, 5)", "messages", lambda r: r.feed_many(0, 5)),
    ("feed_many(0, [b'x'])", "messages[0]", lambda r: r.feed_many(0, [b"x"])),
]


@pytest.mark.parametrize("name,names,call", ROUTER_CASES, ids=[c[0] for c in ROUTER_CASES])
def test_router_bad_input(name, names, call):
    r = fed_router()
    before = router_state(r)
    with pytest.raises(KVPoolError) as info:
        call(r)
    assert isinstance(info.value, InvalidArgumentError), f"{name}: {type(info.value).__name__}: {info.value}"
    assert names in str(info.value), f"{name}: {info.value}"
    assert router_state(r) == before


def test_router_medium_must_be_a_name():
    from kvpool.router import Router

    pytest.importorskip("msgspec")
    with pytest.raises(InvalidArgumentError, match="medium"):
        Router(2, page_size=2, hash_seed=1, medium=np.array(["GPU", "CPU"]))


def test_router_route_still_takes_numpy_loads_and_flags():
    r = fed_router()
    assert r.route(np.arange(6), loads=np.array([3.0, 0.0]), eligible=np.array([True, True])).pool == 0
    assert r.route(np.arange(6), eligible=[False, True]).pool == 1


@pytest.mark.parametrize("kw", [dict(buffer_steps=2**63), dict(data_parallel_rank=np.array([1, 2])),
                                dict(data_parallel_rank=torch.tensor([1, 2]))], ids=str)
def test_publisher_constructor_bad_input(kw):
    from kvpool.events import LocalEventPublisher

    with pytest.raises(InvalidArgumentError, match=next(iter(kw))):
        LocalEventPublisher(small_pool(), **kw)


def test_a_closed_publisher_is_a_typed_error_and_still_a_runtime_error():
    from kvpool.events import LocalEventPublisher

    pytest.importorskip("msgspec")
    pub = LocalEventPublisher(small_pool())
    pub.close()
    with pytest.raises(PublisherClosedError, match="closed") as info:
        pub.publish()
    assert isinstance(info.value, RuntimeError)


def test_collector_publishers_must_be_a_mapping():
    pytest.importorskip("prometheus_client")
    from kvpool.events import LocalEventPublisher
    from kvpool.metrics import KVPoolCollector

    pool = small_pool()
    with pytest.raises(InvalidArgumentError, match="publishers"):
        KVPoolCollector(pool, publishers=[LocalEventPublisher(pool)])


def test_runner_bucket_for_bad_input():
    r = runner()
    for bad in ("3", None, 1.5, np.array([1, 2]), -1):
        with pytest.raises(InvalidArgumentError, match="n must be"):
            r.bucket_for(bad)
    assert r.bucket_for(3) == 4


def test_hf_cache_salt_without_prefix_is_typed():
    pytest.importorskip("transformers")
    __import__("_hf_skip").require_hf()  # transformers may refuse this torch
    from kvpool.integrations.transformers import KVPoolCache

    pool = small_pool()
    with pytest.raises(InvalidArgumentError, match="prefix_ids"):
        KVPoolCache(pool, salt=3)
    assert pool.open_requests == 0
