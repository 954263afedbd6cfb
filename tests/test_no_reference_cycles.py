"""Objects that own memory, sockets or a pool are freed when their last reference goes, not
when the cyclic collector happens to run. A hybrid pool (its req_to_token held the pool), a
TPPool (its recorded calls closed over it) and a ZmqFeed (its idle probes held it) were each
in a reference cycle: rebuilding 1 GiB hybrid pools in a loop held ~9 GiB before a collection
ran (GPU memory on a device, which never triggers one), and feeds dropped without close()
kept their sockets, failing later subscribes with "Address already in use"."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import kvpool


@pytest.fixture
def no_cyclic_gc():
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if was:
        gc.enable()


def test_a_dropped_hybrid_pool_is_freed_at_once(no_cyclic_gc):
    pool = kvpool.KVPool(4, 2, 8, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
                         dtype=torch.float32, page_size=4, num_pages=64, max_requests=4, max_context_len=64)
    h = pool.open(2)
    pool.extend(h, 5)
    assert pool.req_to_token[1].shape == (5, 64) and len(list(pool.req_to_token)) == 4
    gone = weakref.ref(pool)
    del pool
    assert gone() is None


def test_a_dropped_zmq_feed_is_freed_at_once_and_closes_its_sockets(no_cyclic_gc):
    zmq = pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
    from kvpool.events import ZmqEventPublisher
    from kvpool.router import Router, ZmqFeed

    ctx = zmq.Context()
    try:
        with ZmqEventPublisher(kvpool.SlotAllocator(64, 4, 8, 256, hash_seed=1), "tcp://127.0.0.1:0",
                               replay_endpoint="tcp://127.0.0.1:0", context=ctx) as pub:
            feed = ZmqFeed(Router(1, page_size=4, hash_seed=1), context=ctx)
            feed.subscribe(0, pub.endpoint, replay_endpoint=pub.replay_endpoint)
            socks = [*feed._subs, *feed._monitors.values(), *feed._replay.values()]
            gone = weakref.ref(feed)
            del feed
            assert gone() is None
            assert all(s.closed for s in socks)
    finally:
        ctx.destroy(linger=0)


def _tp_dropped(rank, world):
    import gc as gc_

    from kvpool.distributed.tp import tp_pool

    gc_.collect()
    gc_.disable()
    tp = tp_pool(1, 2, 8, dtype=torch.float32, page_size=4, num_pages=16, max_requests=2, max_context_len=32)
    h = tp.open(1)
    tp.extend(h, 3)
    extend = tp.extend  # a recorded call kept past its TPPool still reaches the pool
    inner, outer = weakref.ref(tp.inner), weakref.ref(tp)
    del tp
    freed = outer() is None
    kept = inner() is not None  # (held by the kept call)
    extend(h, 1)
    del extend
    return {"tp_freed": freed, "inner_kept_by_call": kept, "inner_freed": inner() is None}


def test_a_dropped_tp_pool_and_its_pool_are_freed_at_once():
    import _dist

    res = _dist.run_ranks(_tp_dropped, world=1, timeout_s=90)
    assert res[0] == {"tp_freed": True, "inner_kept_by_call": True, "inner_freed": True}, res
