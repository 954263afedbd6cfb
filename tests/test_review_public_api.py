"""What a user gets from ``pip install kvpool``, called the way an outside check calls it:
the public helpers with the user's own inputs, and what their annotations promise.

Each case found a way a public call answered bad input with a bare Python error or,
worse, a plausible wrong answer; the test pins the typed refusal instead.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from _hf_skip import require_hf

import kvpool
from kvpool import InvalidArgumentError


def inference_linear() -> torch.nn.Module:
    with torch.inference_mode():
        return torch.nn.Linear(2, 2)


# ----- audit(max_depth=...) ------------------------------------------------------------------

@pytest.mark.parametrize("depth", [-1, -5, None, "3", 1.5, True, np.bool_(True)], ids=repr)
def test_audit_refuses_a_max_depth_that_is_not_a_depth(depth):
    """A negative depth used to return [] for a model full of inference tensors (a false
    "clean"), None or a str raised a bare TypeError from a comparison deep in the walk."""
    with pytest.raises(InvalidArgumentError, match="max_depth"):
        kvpool.audit(inference_linear(), max_depth=depth)


@pytest.mark.parametrize("depth", [0, 4, np.int64(2), 2**40])
def test_audit_still_takes_int_depths(depth):
    findings = kvpool.audit(model=inference_linear(), max_depth=depth)
    assert sorted(f.name for f in findings) == ["model.bias", "model.weight"]


# ----- kvpool.integrations.transformers: what it is handed -----------------------------------

def plain_pool() -> kvpool.KVPool:
    return kvpool.KVPool(2, 2, 4, num_pages=8, page_size=2, max_requests=4, max_context_len=8)


def hybrid_pool() -> kvpool.KVPool:
    return kvpool.KVPool(2, 2, 4, num_pages=8, page_size=2, max_requests=4, max_context_len=8,
                         layer_types=["full_attention", "sliding_attention"], sliding_window=4)


@pytest.mark.parametrize("pool", [None, 3, "pool", "plain"], ids=repr)
def test_hybrid_cache_refuses_what_is_not_a_hybrid_pool(pool):
    """It read pool.state_shapes first: an AttributeError, also for a plain KVPool (the
    likely mistake, which KVPoolCache serves)."""
    tr = require_hf()
    pool = plain_pool() if pool == "plain" else pool
    with pytest.raises(InvalidArgumentError, match="HybridKVPoolCache") as info:
        tr.HybridKVPoolCache(pool)
    if isinstance(pool, kvpool.KVPool):
        assert "KVPoolCache(pool)" in str(info.value)
        assert pool.open_requests == 0


def test_release_buffers_of_a_hybrid_pool_has_nothing_to_free():
    """docs/transformers.md: release_buffers(pool) frees what closed caches left to the pool.
    On a hybrid pool (whose caches keep no spares) it raised AttributeError: no page_size."""
    tr = require_hf()
    pool = hybrid_pool()
    with tr.KVPoolCache(pool) as cache:
        assert isinstance(cache, tr.HybridKVPoolCache)
    assert tr.release_buffers(pool) == 0
    assert tr.release_buffers(plain_pool()) == 0


@pytest.mark.parametrize("pool", [None, 3, "pool", kvpool.SlotAllocator(8)], ids=repr)
def test_release_buffers_refuses_what_is_not_a_pool(pool):
    tr = require_hf()
    with pytest.raises(InvalidArgumentError, match="release_buffers"):
        tr.release_buffers(pool)


@pytest.mark.parametrize("model", [None, 3, torch.nn.Linear(2, 2), {"num_attention_heads": 2}], ids=repr)
def test_pool_for_model_refuses_what_is_not_a_model_or_config(model):
    """It raised AttributeError: no num_attention_heads."""
    tr = require_hf()
    with pytest.raises(InvalidArgumentError, match="num_attention_heads"):
        tr.pool_for_model(model, max_tokens=64)


# ----- numpy integers where an int is annotated ----------------------------------------------
# Every size and count of the pool, the allocator, the graph runner and the tiers takes a
# numpy integer (a value read from an array or a config), and refuses a bool; these five
# refused numpy integers alone ("must be an int ..., got np.int64(2)").

_ENDPOINTS = itertools.count()


def publisher_kwargs(**kw):
    pytest.importorskip("zmq")
    from kvpool.events import ZmqEventPublisher

    # An endpoint of its own each time: a closed socket's inproc name is released by ZMQ's
    # I/O thread, so the next case binding the same name could find it still in use.
    pub = ZmqEventPublisher(plain_pool(), f"inproc://rev40-np-hwm-{next(_ENDPOINTS)}", **kw)
    pub.close()
    return pub


def tp_check_every(value):
    """TPPool's check_every, on a pool of this single process (no process group to ask
    for the collectives' device)."""
    import kvpool.distributed.tp as tp

    comm_device, tp.comm_device = tp.comm_device, lambda group, device, what="": device
    try:
        return tp.TPPool(plain_pool(), check_every=value).check_every
    finally:
        tp.comm_device = comm_device


NUMPY_INT_CASES = [
    ("KVPool(tp_rank=, tp_size=)", lambda i: kvpool.KVPool(2, 8, 4, num_pages=8, tp_rank=i(1), tp_size=i(2)).num_kv_heads, 4),
    ("shard_kv_heads", lambda i: tuple(kvpool.heads.shard_kv_heads(i(8), i(1), i(2))), (4, 4, 8)),
    ("EventPublisher(buffer_steps=)", lambda i: __import__("kvpool.events", fromlist=["x"]).LocalEventPublisher(
        plain_pool(), buffer_steps=i(3))._buffer.maxlen, 3),
    ("ZmqEventPublisher(hwm=)", lambda i: publisher_kwargs(hwm=i(10)) is not None, True),
    ("TPPool(check_every=)", lambda i: tp_check_every(i(5)), 5),
    ("FileTier(max_bytes=)", lambda i: __import__("kvpool.tiers", fromlist=["x"]).FileTier(
        __import__("tempfile").mkdtemp(prefix="rev40"), i(1 << 15)).max_bytes, 1 << 15),
    ("FileTier(scan_interval_s=)", lambda i: __import__("kvpool.tiers", fromlist=["x"]).FileTier(
        __import__("tempfile").mkdtemp(prefix="rev40"), 1 << 15, scan_interval_s=i(2)).scan_interval_s, 2.0),
]


@pytest.mark.parametrize("name,call,expected", NUMPY_INT_CASES, ids=[c[0] for c in NUMPY_INT_CASES])
@pytest.mark.parametrize("np_int", [np.int64, np.int32, np.uint16], ids=lambda t: t.__name__)
def test_int_arguments_take_numpy_integers(name, call, expected, np_int):
    got = call(np_int)
    assert got == expected and type(got) is type(expected), f"{name}: {got!r}"


@pytest.mark.parametrize("name,call,expected", NUMPY_INT_CASES, ids=[c[0] for c in NUMPY_INT_CASES])
def test_int_arguments_still_refuse_bools(name, call, expected):
    with pytest.raises(InvalidArgumentError):
        call(lambda v: np.bool_(True))


# ----- the constructors' signatures (help(), inspect, IDEs) ----------------------------------

def test_kvpool_signature_is_its_constructor_not_the_hybrid_dispatch():
    """KVPool.__new__ (*args, layer_types, **kwargs) routes hybrid pools; help(kvpool.KVPool)
    and inspect.signature showed that instead of the pool's parameters."""
    import inspect
    import pydoc

    params = inspect.signature(kvpool.KVPool).parameters
    assert list(params)[:3] == ["num_layers", "num_kv_heads", "head_dim"]
    assert {"dtype", "device", "page_size", "num_pages", "layout", "layer_types", "host_pages"} <= set(params)
    assert params["page_size"].default == 1 and params["dtype"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "None" != params["layer_types"].annotation
    inspect.signature(kvpool.KVPool).bind(2, 2, 4, num_pages=8, layer_types=["full_attention"])
    # help()'s call line runs from "KVPool(" to the first blank line: one line up to Python 3.12,
    # one parameter per line from 3.13 (pydoc wraps a long signature).
    lines = pydoc.render_doc(kvpool.KVPool, renderer=pydoc.plaintext).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(" |  KVPool("))
    end = next(i for i in range(start, len(lines)) if not lines[i].strip(" |"))
    call = "\n".join(lines[start:end])
    assert "num_kv_heads" in call and "host_pages" in call and "*args" not in call, call



def test_kvpool_annotations_take_the_documented_hybrid_call():
    """KVPool.__init__ annotated layer_types as None and had no sliding_window / state_shapes /
    group_pages, so mypy --strict rejected docs/hybrid.md's KVPool(..., layer_types=[...],
    sliding_window=W) ("Unexpected keyword argument"), and help() did not list them."""
    import inspect
    import typing

    hints = typing.get_type_hints(kvpool.KVPool.__init__)
    assert hints["layer_types"] is not type(None) and type(None) in typing.get_args(hints["layer_types"])
    for name in ("sliding_window", "state_shapes", "group_pages"):
        assert name in hints and inspect.signature(kvpool.KVPool).parameters[name].default is None
    inspect.signature(kvpool.KVPool).bind(4, 2, 8, layer_types=["full_attention"] * 4, sliding_window=4,
                                          state_shapes={"s": (3,)}, group_pages={"full_attention": 8})
    # The plain pool still refuses them without layer_types, and builds a hybrid one with it.
    with pytest.raises(InvalidArgumentError, match="sliding_window applies to hybrid pools"):
        kvpool.KVPool(2, 1, 4, num_pages=8, sliding_window=4)
    from kvpool.hybrid import HybridKVPool
    assert isinstance(kvpool.KVPool(2, 1, 4, num_pages=8, layer_types=["full_attention"] * 2), HybridKVPool)

def test_kvpool_cache_signature_is_its_constructor():
    import inspect

    tr = require_hf()
    for cls in (tr.KVPoolCache, tr.HybridKVPoolCache):
        params = inspect.signature(cls).parameters
        assert list(params) == ["pool", "prefix_ids", "salt", "layer_buffers"]
        assert params["pool"].default is inspect.Parameter.empty


# ----- kernel scales: a number, never a flag -------------------------------------------------

def scaled_store(scale):
    from kvpool.kernels import store_kv

    kc, vc = torch.zeros(8, 2, 4), torch.zeros(8, 2, 4)
    store_kv(kc, vc, torch.tensor([1, 2]), torch.full((2, 2, 4), 2.0), torch.full((2, 2, 4), 2.0), k_scale=scale)
    return kc


@pytest.mark.parametrize("scale", [True, np.bool_(True), False], ids=repr)
def test_store_kv_refuses_a_bool_scale(scale):
    """k_scale=True stored x / 1 (a flag taken for a number) and False said 'must be > 0'."""
    from kvpool import KernelArgumentError

    with pytest.raises(KernelArgumentError, match="k_scale"):
        scaled_store(scale)


@pytest.mark.parametrize("scale", [2.0, 2, np.float32(2.0), np.float64(2.0), np.int64(2)], ids=repr)
def test_store_kv_takes_numeric_scales(scale):
    """np.float32 (a value read from a checkpoint's array) was refused."""
    assert scaled_store(scale)[1].eq(1.0).all()


def test_file_tier_scan_interval_takes_a_numpy_float():
    import tempfile

    from kvpool.tiers import FileTier

    assert FileTier(tempfile.mkdtemp(prefix="rev40"), 1 << 15, scan_interval_s=np.float32(0.5)).scan_interval_s == 0.5


# ----- the counters' annotations (typeguard / beartype check them at runtime) ----------------

def test_every_pool_counter_returns_what_it_is_annotated():
    """KVPool.clock (seconds, a float) was annotated int, like the page counters."""
    import typing

    pool = kvpool.KVPool(2, 2, 4, num_pages=8, page_size=2, host_pages=4)
    checked = 0
    for name, prop in vars(kvpool.lifecycle.RequestOps).items():
        if isinstance(prop, property):
            kind = typing.get_type_hints(prop.fget)["return"]
            value = getattr(pool, name)
            # (A bool is an int: only a property annotated bool may return one.)
            assert isinstance(value, kind) and (kind is bool or not isinstance(value, bool)), \
                f"{name}: {value!r} is not {kind}"
            checked += 1
    assert checked >= 20


def test_a_whole_float_count_gets_one_suggestion():
    """num_pages=8.0 said 'use 8 or 8'."""
    with pytest.raises(InvalidArgumentError) as info:
        kvpool.KVPool(2, 2, 4, num_pages=8.0)
    assert str(info.value).endswith("got float 8.0; use 8"), str(info.value)
    with pytest.raises(InvalidArgumentError, match="use 8 or 9$"):
        kvpool.KVPool(2, 2, 4, num_pages=8.5)


@pytest.mark.parametrize("name", ["sliding_window", "state_shapes", "group_pages"])
def test_plain_pool_takes_the_hybrid_keywords_default_none(name):
    """KVPool's signature gives sliding_window / state_shapes / group_pages the default None, but
    passing that None explicitly without layer_types (a wrapper forwarding a plain model's
    config.sliding_window) was refused as 'applies to hybrid pools'. None now asks for nothing, as
    leaving it out does; a value still needs layer_types."""
    pool = kvpool.KVPool(2, 1, 4, num_pages=8, layer_types=None, **{name: None})
    assert type(pool) is kvpool.KVPool and pool.allocator.num_pages == 8
    value = {"sliding_window": 4, "state_shapes": {"s": (3,)}, "group_pages": {"full_attention": 8}}[name]
    with pytest.raises(InvalidArgumentError, match=f"{name} applies to hybrid pools"):
        kvpool.KVPool(2, 1, 4, num_pages=8, **{name: value})
