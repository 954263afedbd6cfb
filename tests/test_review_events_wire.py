"""Outside checks of the KV event surfaces (review 38): driven through the public API
with their own traces, and decoded with the routers' own definitions."""

import numpy as np
import pytest

import kvpool

zmq = pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
from kvpool.events import ZmqEventPublisher  # noqa: E402
from kvpool.router import Router, ZmqFeed  # noqa: E402

P, SEED = 4, 11
LOOP = "tcp://127.0.0.1:0"


def admit(a, tokens):
    tokens = np.asarray(tokens, dtype=np.int64)
    h, c = a.open_with_prefix(tokens, [len(tokens)])
    a.extend(h, len(tokens) - int(c[0]))
    a.close(h, cache=True)


class Forwarder:
    """An XSUB/XPUB forwarder pumped by hand (no thread): publishers connect to
    ``inbound``, subscribers to ``outbound``, as the docs' "connects (to a forwarder)"."""

    def __init__(self):
        ctx = zmq.Context.instance()
        self.xsub, self.xpub = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
        self.xsub.bind(LOOP)
        self.xpub.bind(LOOP)
        self.inbound = self.xsub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.outbound = self.xpub.getsockopt_string(zmq.LAST_ENDPOINT)

    def pump(self, timeout_ms=20):
        poller = zmq.Poller()
        poller.register(self.xsub, zmq.POLLIN)
        poller.register(self.xpub, zmq.POLLIN)
        for sock, _ in poller.poll(timeout_ms):
            other = self.xpub if sock is self.xsub else self.xsub
            while sock.poll(0):
                other.send_multipart(sock.recv_multipart())

    def close(self):
        self.xsub.close(linger=0)
        self.xpub.close(linger=0)


def test_a_feed_takes_only_its_pools_topic_not_every_topic_it_prefixes():
    # Two engines publish through one forwarder under the topics "pool1" and
    # "pool10". ZMQ subscriptions match by prefix, so the SUB socket of the pool
    # subscribed to "pool1" also receives "pool10"'s batches; the feed applied
    # them to that pool, and the router believed in pages it never held.
    fwd = Forwarder()
    a1, a10 = (kvpool.SlotAllocator(64, P, 8, 256, hash_seed=SEED) for _ in range(2))
    pub1 = ZmqEventPublisher(a1, fwd.inbound, topic="pool1")
    pub10 = ZmqEventPublisher(a10, fwd.inbound, topic="pool10")
    router = Router(2, page_size=P, hash_seed=SEED)
    feed = ZmqFeed(router)
    try:
        feed.subscribe(0, fwd.outbound, topic="pool1")
        feed.subscribe(1, fwd.outbound, topic="pool10")
        for attempt in range(100):  # until the subscriptions reach pool10's publisher
            admit(a10, [7000 + attempt] * (P + 1))
            pub10.publish()
            pub10.flush(5)
            fwd.pump()
            feed.poll(20)
            if router.pages(1):
                break
        else:
            raise AssertionError("the feed never received a batch of pool10")
        prompt = np.arange(500, 500 + 3 * P + 1)
        admit(a10, prompt)
        assert pub10.publish() == 3
        pub10.flush(5)
        fwd.pump()
        feed.poll(200)
        assert router.match(prompt) == [0, 3 * P], "only pool10's own stream names pool10's pages"
        assert router.pages(0) == 0, "pool1 published nothing"
    finally:
        feed.close()
        pub1.close()
        pub10.close()
        fwd.close()


def test_a_message_that_is_not_a_batch_is_typed_and_other_topics_are_skipped():
    # A SUB socket hands over whatever arrives under a matching prefix. A
    # message of another shape under the pool's topic raised ValueError (three
    # frames unpacked) from poll(); one under another topic is not the pool's.
    from kvpool.events import LocalEventPublisher

    a = kvpool.SlotAllocator(64, P, 8, 256, hash_seed=SEED)
    local = LocalEventPublisher(a, topic="kv")
    raw = zmq.Context.instance().socket(zmq.PUB)
    raw.bind(LOOP)
    router = Router(1, page_size=P, hash_seed=SEED)
    feed = ZmqFeed(router)
    try:
        feed.subscribe(0, raw.getsockopt_string(zmq.LAST_ENDPOINT), topic="kv")
        for attempt in range(100):  # until the subscription has reached the PUB socket
            admit(a, [7000 + attempt] * (P + 1))
            local.publish()
            for m in local.drain():
                raw.send_multipart(m)
            feed.poll(20)
            if router.pages(0):
                break
        else:
            raise AssertionError("the feed never received a batch")
        before = router.pages(0)
        raw.send_multipart((b"kv10", b"another stream's shape"))
        raw.send_multipart((b"kv", b"not a batch"))
        admit(a, np.arange(300, 300 + P + 1))
        assert local.publish() == 1
        (m,) = local.drain()
        raw.send_multipart(m)
        with pytest.raises(kvpool.InvalidArgumentError, match="2 frames"):
            for _ in range(100):
                feed.poll(20)
        assert router.pages(0) == before, "nothing applied from the stray messages"
        for _ in range(100):  # the batch behind them is applied by the next poll
            if feed.poll(20):
                break
        assert router.pages(0) == before + 1
    finally:
        feed.close()
        raw.close(linger=0)


def test_close_during_a_publish_sends_that_batch_before_the_publisher_stops():
    # close() from another thread (an engine's shutdown hook) while publish() was
    # between draining the pool and handing the batch over: the batch was queued
    # behind the sender thread's stop sentinel, never sent (its events drained
    # and lost), and flush() then waited for it forever.
    import threading

    a = kvpool.SlotAllocator(64, P, 8, 256, hash_seed=SEED)
    entered, go = threading.Event(), threading.Event()

    class SlowPool:  # drains the pool, then waits: publish() is inside its drain
        def take_events(self):
            ev = a.take_events()
            entered.set()
            go.wait()
            return ev

    pub = ZmqEventPublisher(SlowPool(), LOOP)
    admit(a, np.arange(40, 40 + P + 1))
    sent = []
    publisher = threading.Thread(target=lambda: sent.append(pub.publish()))
    publisher.start()
    assert entered.wait(30)
    closer = threading.Thread(target=pub.close)
    closer.start()
    closer.join(0.5)  # a fixed close waits for the publish; the old one returned
    go.set()
    publisher.join()
    closer.join()
    assert sent == [1]
    assert pub.flush(0), "the batch was sent before the publisher stopped"
    assert pub.batches == 1
