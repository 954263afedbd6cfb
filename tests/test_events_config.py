"""A KV event publisher built with a bad configuration fails at construction with
InvalidArgumentError that names the argument, not later at publish() (with events
already drained) and not as a TypeError / ZMQError; no socket is left open."""

import numpy as np
import pytest

import kvpool

msgspec = pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
zmq = pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
from kvpool.events import LocalEventPublisher, ZmqEventPublisher  # noqa: E402


def alloc():
    a = kvpool.SlotAllocator(16, 4, 4, 64, hash_seed=1)
    h, _ = a.open_with_prefix(np.arange(9), [9])
    a.extend(h, 9)
    a.cache(h)
    return a  # two full pages registered: two Stored events


@pytest.mark.parametrize("kw, match", [
    (dict(topic=5), "topic"),
    (dict(topic=b"kv"), "topic"),
    (dict(data_parallel_rank="0"), "data_parallel_rank"),
    (dict(data_parallel_rank=1.0), "data_parallel_rank"),
    (dict(data_parallel_rank=True), "data_parallel_rank"),
    (dict(data_parallel_rank=-1), "data_parallel_rank"),
    (dict(data_parallel_rank=2**63), "data_parallel_rank"),
    (dict(topic="\ud800"), "topic"),
], ids=str)
def test_bad_publisher_arguments_are_typed_and_drain_nothing(kw, match):
    a = alloc()
    with pytest.raises(kvpool.InvalidArgumentError, match=match):
        LocalEventPublisher(a, **kw)
    assert len(a.take_events()["kind"]) == 2, "the pool's events are still there"


def test_a_pool_without_events_is_typed():
    with pytest.raises(kvpool.InvalidArgumentError, match="take_events"):
        LocalEventPublisher(object())


@pytest.mark.parametrize("torch_pool", [False, True], ids=["SlotAllocator", "KVPool"])
def test_a_pool_built_without_kv_events_is_refused(torch_pool):
    """Was accepted, and every publish() sent an empty batch for good (DiskCache, which
    also learns the cache from the events, refused the same pool)."""
    import torch

    pool = (kvpool.KVPool(1, 1, 8, dtype=torch.float32, num_pages=16, kv_events=False) if torch_pool
            else kvpool.SlotAllocator(16, 4, 4, 64, kv_events=False))
    with pytest.raises(kvpool.InvalidArgumentError, match="kv_events=False"):
        LocalEventPublisher(pool)


def test_a_terminated_context_is_typed():
    """Was: a raw zmq.ZMQError from its first socket() (the router's feed checks the same)."""
    ctx = zmq.Context()
    ctx.term()
    with pytest.raises(kvpool.InvalidArgumentError, match="terminated"):
        ZmqEventPublisher(alloc(), "tcp://127.0.0.1:0", context=ctx)


def test_good_rank_and_topic_are_sent():
    a = alloc()
    pub = LocalEventPublisher(a, topic="kv", data_parallel_rank=np.int64(2))
    assert pub.publish() == 2
    (topic, _seq, payload), = pub.drain()
    from kvpool.events import schema
    assert topic == b"kv" and schema.decoder().decode(payload).data_parallel_rank == 2


def test_the_rank_is_0_unless_given_and_nil_when_none():
    # vLLM's publisher fills every batch's rank with its engine's (0 without data parallelism):
    # a router reading the batch as [ts, events, int] sees kvpool's batches the same way.
    from kvpool.events import schema
    for kw, want in (({}, 0), ({"data_parallel_rank": None}, None), ({"data_parallel_rank": 3}, 3)):
        pub = LocalEventPublisher(alloc(), **kw)
        assert pub.publish() == 2
        (_topic, _seq, payload), = pub.drain()
        assert msgspec.msgpack.decode(payload)[2] == want and schema.decoder().decode(payload).data_parallel_rank == want


@pytest.mark.parametrize("endpoint, kw, match", [
    ("not-an-endpoint", {}, "endpoint"),
    (5, {}, "endpoint"),
    ("tcp://127.0.0.1:99999", {}, "port '99999'"),  # (ZMQ bound port 99999 - 65536)
    ("tcp://127.0.0.1:-1", {}, "port '-1'"),
    ("tcp://127.0.0.1:", {}, "port ''"),  # (no port: was told "names port ;")
    # '²' raised int()'s untyped ValueError; '٣' reached ZMQ as a port.
    ("tcp://127.0.0.1:\u00b2", {}, "port '\u00b2'"),
    ("tcp://127.0.0.1:0", dict(replay_endpoint="tcp://127.0.0.1:\u0663"), "port '\u0663'"),
    ("tcp://127.0.0.1:0", dict(replay_endpoint="tcp://127.0.0.1:70000"), "port '70000'"),
    ("tcp://127.0.0.1:0", dict(hwm="x"), "hwm"),
    ("tcp://127.0.0.1:0", dict(hwm=-5), "hwm"),
    ("tcp://127.0.0.1:0", dict(hwm=True), "hwm"),
    ("tcp://127.0.0.1:0", dict(replay_endpoint="not-an-endpoint"), "replay_endpoint"),
    ("tcp://127.0.0.1:0", dict(replay_endpoint=7), "replay_endpoint"),
    ("tcp://127.0.0.1:0", dict(replay_topic_frame="no"), "replay_topic_frame"),
    ("tcp://127.0.0.1:0", dict(replay_topic_frame=0), "replay_topic_frame"),
], ids=str)
def test_bad_zmq_publisher_arguments_are_typed(endpoint, kw, match):
    a = alloc()
    ctx = zmq.Context()
    try:
        with pytest.raises(kvpool.InvalidArgumentError, match=match):
            ZmqEventPublisher(a, endpoint, context=ctx, **kw).close()  # close: a wrongly built one
        assert len(a.take_events()["kind"]) == 2
    finally:
        ctx.term()  # returns only once every socket made on it is closed


@pytest.mark.parametrize("timeout", ["5", float("nan"), -1, True, [5]], ids=repr)
def test_a_bad_flush_timeout_is_typed(timeout):
    # Was: accepted while nothing was queued (True), and with a batch queued a
    # TypeError from threading, or for NaN a wait that no timeout ended.
    a = alloc()
    with ZmqEventPublisher(a, "inproc://flush-timeout") as pub:
        with pytest.raises(kvpool.InvalidArgumentError, match="timeout must be None"):
            pub.flush(timeout)
        assert pub.publish() == 2 and pub.flush(5)


@pytest.mark.parametrize("timeout", [float("inf"), 10**400, 1e300])
def test_an_endless_flush_timeout_waits_as_none(timeout):
    # Was: OverflowError (threading's clock cannot hold the deadline) once a message was queued.
    import threading

    with ZmqEventPublisher(alloc(), "inproc://flush-endless") as pub:
        sender = pub._sender
        pub._queued += 1  # a message that the sender has not sent yet: flush must wait for it

        def sent():
            with sender.sent:
                sender.done += 1
                sender.sent.notify_all()

        timer = threading.Timer(0.05, sent)
        timer.start()
        try:
            assert pub.flush(timeout) is True
        finally:
            timer.join()
