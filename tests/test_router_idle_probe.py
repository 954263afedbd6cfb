"""A router behind ZMQ learns the batches it missed at the end of a burst while the engine
stays idle: a gap shows only when a later batch arrives, so without a probe the router
kept predicting pages the pool had evicted until the engine's next step."""

import time

import numpy as np
import pytest

import kvpool

zmq = pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
from kvpool.events import ZmqEventPublisher  # noqa: E402
from kvpool.router import Router, ZmqFeed  # noqa: E402

P, SEED = 4, 5
LOOP = "tcp://127.0.0.1:0"


def admit(a, tokens):
    tokens = np.asarray(tokens, dtype=np.int64)
    h, c = a.open_with_prefix(tokens, [len(tokens)])
    a.extend(h, len(tokens) - int(c[0]))
    a.close(h, cache=True)


def lose_the_last_batch(idle_probe_ms, **publisher_kw):
    """Pool 0 caches a prompt (the router learns it), then evicts it in a batch the feed's
    SUB socket loses; the engine publishes nothing after. What the router predicts of the
    prompt after `poll()` for up to 3 s, and the feed."""
    a = kvpool.SlotAllocator(256, P, 8, 256, hash_seed=SEED)
    pub = ZmqEventPublisher(a, LOOP, replay_endpoint=LOOP, **publisher_kw)
    router = Router(1, page_size=P, hash_seed=SEED)
    feed = ZmqFeed(router, idle_probe_ms=idle_probe_ms)
    prompt = np.arange(300, 313)
    try:
        feed.subscribe(0, pub.endpoint, replay_endpoint=pub.replay_endpoint)
        for attempt in range(50):  # until the subscription is live
            admit(a, [7000 + attempt] * (P + 1))
            pub.publish()
            pub.flush(5)
            if feed.poll(100):
                break
        admit(a, prompt)
        pub.publish()
        pub.flush(5)
        deadline = time.monotonic() + 5
        while router.match(prompt)[0] == 0 and time.monotonic() < deadline:
            feed.poll(50)
        assert router.match(prompt)[0] == 12
        sub = next(iter(feed._subs))
        feed._poller.unregister(sub)
        a.evict(a.evictable_pages)  # the prompt's pages go
        pub.publish()
        pub.flush(5)
        time.sleep(0.2)
        while sub.poll(0):
            sub.recv_multipart()  # dropped, as past a high-water mark
        feed._poller.register(sub, zmq.POLLIN)
        deadline = time.monotonic() + 3
        while router.match(prompt)[0] != 0 and time.monotonic() < deadline:
            feed.poll(50)
        return router.match(prompt)[0], feed
    finally:
        feed.close()
        pub.close()


def test_an_idle_probe_brings_back_batches_lost_at_the_end_of_a_burst():
    predicted, feed = lose_the_last_batch(idle_probe_ms=200)
    assert predicted == 0  # the eviction reached the router without another engine step
    assert feed.probes >= 1 and feed.replays == 0


def test_an_idle_probe_reads_replay_answers_without_the_topic_frame():
    """SGLang's publishers (and vLLM's before the topic frame) answer ``(b"", seq, payload)``:
    the feed skipped every such answer and its end marker, so it filled no gap from them."""
    predicted, feed = lose_the_last_batch(idle_probe_ms=200, replay_topic_frame=False)
    assert predicted == 0 and feed.probes >= 1


def test_without_probes_the_router_would_not_know():
    predicted, feed = lose_the_last_batch(idle_probe_ms=None)
    assert predicted == 12 and feed.probes == 0  # what the probe fixes


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "1000"])
def test_idle_probe_ms_is_checked(bad):
    with pytest.raises(kvpool.InvalidArgumentError, match="idle_probe_ms"):
        ZmqFeed(Router(1, page_size=P, hash_seed=SEED), idle_probe_ms=bad)


def test_probes_to_a_publisher_that_is_not_up_never_queue_or_block():
    # An engine not started yet (nothing on either port): probes are not queued to be sent
    # later (ZMQ would pile them up to its high-water mark, then block poll() for good).
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    feed = ZmqFeed(Router(1, page_size=P, hash_seed=SEED), idle_probe_ms=1, replay_timeout_ms=0)
    try:
        feed.subscribe(0, f"tcp://127.0.0.1:{ports[0]}", replay_endpoint=f"tcp://127.0.0.1:{ports[1]}")
        t0 = time.monotonic()
        for _ in range(300):
            feed.poll(0)
            time.sleep(0.001)
        assert feed.probes == 0 and time.monotonic() - t0 < 30
    finally:
        feed.close()


def test_an_idle_pool_whose_publisher_restarted_is_checked_without_its_next_message():
    """A pool's publisher disconnected and came back as a restarted engine (an empty cache)
    that published nothing since (or whose first batch the reconnecting SUB lost): the pool
    was suspect, so probes skipped it, and only its next message was checked, so the router
    kept predicting the old engine's pages while the engine stayed idle. An idle suspect pool
    is now checked by a replay overlap, which the restarted publisher cannot show."""
    a = kvpool.SlotAllocator(64, P, 8, 256, hash_seed=SEED)
    pub = ZmqEventPublisher(a, LOOP, replay_endpoint=LOOP)
    router = Router(1, page_size=P, hash_seed=SEED)
    feed = ZmqFeed(router, idle_probe_ms=50, replay_timeout_ms=300)
    prompt = np.arange(300, 313)
    try:
        feed.subscribe(0, pub.endpoint, replay_endpoint=pub.replay_endpoint)
        deadline = time.monotonic() + 5
        while router.match(prompt)[0] == 0 and time.monotonic() < deadline:
            if not a.evictable_pages:
                admit(a, prompt)
            pub.publish()  # (again until the slow-joining SUB gets one; a replay fills the rest)
            pub.flush(5)
            feed.poll(50)
        assert router.match(prompt)[0] == 12
        ep, rep = pub.endpoint, pub.replay_endpoint
        pub.close()
        a = kvpool.SlotAllocator(64, P, 8, 256, hash_seed=SEED)  # the restarted engine: nothing cached
        pub = ZmqEventPublisher(a, ep, replay_endpoint=rep)
        deadline = time.monotonic() + 5
        while (feed.disconnects == 0 or router.match(prompt)[0] != 0) and time.monotonic() < deadline:
            feed.poll(50)
        assert feed.disconnects >= 1
        assert router.match(prompt)[0] == 0, "the restarted engine holds none of the old pages"
    finally:
        feed.close()
        pub.close()
