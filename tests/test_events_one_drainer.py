"""A pool's events form one stream, and each drain takes them from every other reader.

Outside checks found three ways a router behind a publisher silently kept prefixes the
pool had evicted: a second publisher on the pool, a ``DiskCache.store_new()`` draining by
itself (docs told the engine to hand it the events it drained, but ``publish()`` could not
send events drained elsewhere), and a hybrid pool's publish whose encoding failed after
the drain (the events were gone, nothing in the stream said so)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
import kvpool.events.publisher as publisher_module
from kvpool.events import LocalEventPublisher
from kvpool.router import Router
from kvpool.tiers import DiskCache, FileTier

P = 4


def plain_pool() -> kvpool.KVPool:
    return kvpool.KVPool(2, 1, 8, dtype=torch.float32, page_size=P, num_pages=16, max_requests=4,
                         max_context_len=64, hash_seed=7)


def cache_prompt(pool, tokens) -> None:
    h, r = pool.admit([len(tokens)], tokens=tokens)
    for layer in range(pool.num_layers):
        x = torch.ones(len(tokens), 1, 8)
        pool.write(layer, r.slots if not hasattr(r, "for_layer") else r.for_layer(layer), x, x)
    pool.close(h, cache=True)


def routed(pool, pub) -> Router:
    router = Router(1, page_size=P, hash_seed=pool.hash_seed)
    router.feed_many(0, pub.drain())
    return router


def test_a_second_publisher_on_a_pool_is_refused_until_the_first_closes():
    pool = plain_pool()
    first = LocalEventPublisher(pool)
    for target in (pool, pool.allocator):  # the pool and its allocator are one stream
        with pytest.raises(kvpool.InvalidArgumentError, match="published already"):
            LocalEventPublisher(target)
    cache_prompt(pool, list(range(9)))
    assert first.publish() == 2  # nothing was taken from it
    first.close()
    second = LocalEventPublisher(pool.allocator)
    pool.evict(2)
    assert second.publish() == 2
    other = LocalEventPublisher(plain_pool())  # another pool's stream is its own
    other.close()


def test_disk_store_new_refuses_to_drain_what_a_publisher_sends(tmp_path):
    pool = plain_pool()
    pub = LocalEventPublisher(pool)
    disk = DiskCache(pool, FileTier(tmp_path, 1 << 20), model="m")
    tokens = list(range(100, 109))
    cache_prompt(pool, tokens)
    with pytest.raises(kvpool.InvalidArgumentError, match=r"events = pool.take_events\(\)"):
        disk.store_new()
    # Drained once, handed to both: the disk writes the pages and the router learns them.
    events = pool.take_events()
    assert disk.store_new(events) == 2
    assert pub.publish(events) == 2
    router = routed(pool, pub)
    assert router.match(tokens)[0] == 8
    pool.evict(2)
    events = pool.take_events()
    disk.store_new(events)
    pub.publish(events)
    router.feed_many(0, pub.drain())
    assert router.match(tokens)[0] == 0  # the eviction reached the router too
    pub.close()
    cache_prompt(pool, list(range(200, 209)))
    assert disk.store_new() == 2  # with no publisher, store_new drains by itself again


def test_disk_store_new_refuses_events_of_a_pool_of_another_page_size(tmp_path):
    """They were taken in, then failed with an IndexError, in that call and every later one."""
    pool = plain_pool()
    other = kvpool.KVPool(2, 1, 8, dtype=torch.float32, page_size=2, num_pages=16, max_requests=4,
                          max_context_len=64, hash_seed=7)
    disk = DiskCache(pool, FileTier(tmp_path, 1 << 20), model="m")
    tokens = list(range(100, 109))
    cache_prompt(pool, tokens)
    cache_prompt(other, tokens)
    with pytest.raises(kvpool.InvalidArgumentError, match="Stored pages of 2 tokens, and this pool's pages hold 4"):
        disk.store_new(other.take_events())
    assert disk.store_new() == 2  # the pool's own pages, as if the foreign events never came


@pytest.mark.parametrize("bad", [{"kind": [0]}, [1, 2], {"kind": np.zeros((2, 2), np.int64)}])
def test_publish_of_events_that_are_not_take_events_sends_nothing(bad):
    pool = plain_pool()
    pub = LocalEventPublisher(pool)
    cache_prompt(pool, list(range(9)))
    with pytest.raises(kvpool.InvalidArgumentError, match="events"):
        pub.publish(bad)
    assert pub.next_seq == 0 and pub.drain() == []
    assert pub.publish() == 2  # the pool still holds its events



@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
def test_publish_refuses_events_of_a_pool_of_another_page_size(hybrid):
    """Was: sent, so the stream carried pages of another size (a router behind it then
    refused the pool's stream, far from the cause); DiskCache.store_new refused them already."""
    extra = dict(layer_types=["full_attention", "sliding_attention"], sliding_window=8) if hybrid else {}
    pool = kvpool.KVPool(2, 1, 8, dtype=torch.float32, page_size=P, num_pages=16, max_requests=4,
                         max_context_len=64, hash_seed=7, **extra)
    other = kvpool.KVPool(2, 1, 8, dtype=torch.float32, page_size=2, num_pages=16, max_requests=4,
                          max_context_len=64, hash_seed=7)
    pub = LocalEventPublisher(pool)
    tokens = list(range(100, 109))
    cache_prompt(pool, tokens)
    cache_prompt(other, tokens)
    with pytest.raises(kvpool.InvalidArgumentError, match=f"Stored pages of 2 tokens, and this pool's pages hold {P}"):
        pub.publish(other.take_events())
    assert pub.next_seq == 0 and pub.drain() == []
    assert pub.publish(pool.take_events()) == 2  # the pool's own, as if the foreign events never came

def test_publish_sends_the_group_idx_of_events_it_is_given():
    """``publish(events=)`` kept ``medium`` but dropped a ``group_idx`` array, which
    ``encode_kv_events`` sends: a caller's per-event groups never reached the wire."""
    from kvpool.events import schema

    pool = kvpool.KVPool(2, 1, 8, dtype=torch.float32, page_size=P, num_pages=16, max_requests=4,
                         max_context_len=64, hash_seed=7)
    pub = LocalEventPublisher(pool)
    cache_prompt(pool, list(range(100, 109)))
    ev = dict(pool.take_events())
    ev["group_idx"] = np.full(len(ev["kind"]), 3, np.int64)
    assert pub.publish(ev) == 2
    ((_, _, payload),) = pub.drain()
    assert [e.group_idx for e in schema.decoder().decode(payload).events] == [3]
    ev["group_idx"] = ev["group_idx"][:1]
    with pytest.raises(kvpool.InvalidArgumentError, match="group_idx"):
        pub.publish(ev)


def hybrid_publish_failed_once(monkeypatch, prompt):
    """A hybrid pool that cached ``prompt`` (two Stored events) and a publisher whose first
    ``publish()`` failed encoding them (a MemoryError, injected)."""
    pool = kvpool.KVPool(2, 1, 8, layer_types=["full_attention", "sliding_attention"], sliding_window=8,
                         dtype=torch.float32, page_size=P, num_pages=16, max_requests=4, max_context_len=64,
                         hash_seed=7)
    pub = LocalEventPublisher(pool)
    cache_prompt(pool, prompt)
    real = publisher_module.encode_kv_events
    calls = []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(publisher_module, "encode_kv_events", failing_once)
    with pytest.raises(MemoryError):
        pub.publish()
    return pool, pub


def test_a_hybrid_pools_failed_encode_keeps_its_events_for_the_next_publish(monkeypatch):
    pool, pub = hybrid_publish_failed_once(monkeypatch, list(range(9)))
    assert pub.next_seq == 0
    assert pub.publish() == 2  # the two Stored events drained by the failed call
    router = Router(1, page_size=P, hash_seed=pool.hash_seed)
    router.feed_many(0, pub.drain())
    assert router.match(list(range(9)))[0] == 8


def test_a_failed_publish_then_publish_of_drained_events_sends_the_kept_ones_first(monkeypatch):
    # A hybrid pool's publish() that failed encoding keeps what it drained; a later
    # publish(events) must not send newer events (a Removed) before those older ones (the Stored).
    prompt = list(range(9))
    pool, pub = hybrid_publish_failed_once(monkeypatch, prompt)  # the two Stored events are kept
    pool.clear_cache()
    assert pub.publish(pool.take_events()) == 3  # the kept Stored, then the Cleared
    router = Router(1, page_size=P, hash_seed=pool.hash_seed)
    router.feed_many(0, pub.drain())
    assert router.match(prompt)[0] == 0 and pub.next_seq == 2


def test_a_zmq_publisher_whose_construction_fails_leaves_the_pool_free():
    zmq = pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
    from kvpool.events import ZmqEventPublisher

    pool = plain_pool()
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 1)
    try:
        held = ctx.socket(zmq.PUB)  # the only socket the context allows
        kept_error = None
        try:
            ZmqEventPublisher(pool, "tcp://127.0.0.1:0", context=ctx)
        except zmq.ZMQError as e:
            kept_error = e  # a caller (a logger) keeping the error and its traceback
        assert kept_error is not None
        second = LocalEventPublisher(pool)  # the half-made publisher does not hold the pool
        second.close()
        held.close(linger=0)
    finally:
        ctx.destroy(linger=0)  # (closes any socket left open, rather than wait for it)


def test_a_zmq_publisher_dropped_without_close_frees_its_pool_thread_and_address():
    """The sender thread held the publisher (its bound method), so one dropped without
    ``close()`` lived on: the pool refused every later publisher, and the address stayed bound."""
    pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
    import gc
    import threading
    import weakref

    from kvpool.events import ZmqEventPublisher

    pool = plain_pool()
    pub = ZmqEventPublisher(pool, "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    endpoint, thread, gone = pub.endpoint, pub._thread, weakref.ref(pub)
    cache_prompt(pool, list(range(8)))
    assert pub.publish() > 0 and pub.flush(5.0)
    del pub
    gc.collect()
    assert gone() is None, "something still holds the dropped publisher"
    thread.join(5.0)
    assert not thread.is_alive(), "the dropped publisher's sender thread still runs"
    assert not any(t is thread for t in threading.enumerate())
    with ZmqEventPublisher(pool, endpoint) as again:  # the pool and the address are free
        cache_prompt(pool, list(range(100, 108)))
        assert again.publish() > 0 and again.flush(5.0)


def test_publishers_dropped_without_close_leave_no_entries_behind():
    """Each publisher collected without ``close()`` left its pool's entry in the drainer
    registry (a dead reference that release never removed): a process making pools and
    dropping their publishers grew the registry without end."""
    import gc

    from kvpool.events import drainers

    for _ in range(20):
        LocalEventPublisher(plain_pool())  # dropped at once, never closed
    gc.collect()
    pool = plain_pool()
    with LocalEventPublisher(pool):
        dead = [k for k, r in drainers._PUBLISHERS.items() if r() is None]
        assert dead == [], f"{len(dead)} entries of collected publishers are still registered"


def test_a_forked_child_keeps_the_inherited_local_publisher_as_the_pools_drainer():
    import os

    pool = plain_pool()
    pub = LocalEventPublisher(pool)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child can still publish through the inherited one: no second drainer
        try:
            LocalEventPublisher(pool)
            os.write(w, b"allowed")
        except kvpool.InvalidArgumentError:
            os.write(w, b"refused")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 16) == b"refused"
    pub.close()
