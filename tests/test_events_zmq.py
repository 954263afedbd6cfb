"""ZmqEventPublisher on loopback: vLLM's (topic, seq, payload) frames, its ROUTER
replay protocol, replay after a dropped subscriber, and a router fed over ZMQ
that fills a gap by replay or forgets the pool when it cannot, and an engine
restarted on the same endpoints."""

import time

import numpy as np
import pytest

import kvpool

zmq = pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
from kvpool.events import ZmqEventPublisher, schema  # noqa: E402
from kvpool.router import Router, ZmqFeed  # noqa: E402

P, SEED = 4, 5
LOOP = "tcp://127.0.0.1:0"
END = (-1).to_bytes(8, "big", signed=True)


def pool():
    return kvpool.SlotAllocator(256, P, 8, 256, hash_seed=SEED)


def admit(a, tokens):
    tokens = np.asarray(tokens, dtype=np.int64)
    h, c = a.open_with_prefix(tokens, [len(tokens)])
    a.extend(h, len(tokens) - int(c[0]))
    a.close(h, cache=True)


def sub_socket(endpoint, topic=b""):
    s = zmq.Context.instance().socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, topic)
    s.connect(endpoint)
    return s


def recv(sock, timeout_ms=2000):
    assert sock.poll(timeout_ms), "no message within the timeout"
    return sock.recv_multipart()


def wait_subscribed(pub, sub, a):
    """PUB drops messages until the subscription has arrived: publish probes until one gets through."""
    for i in range(50):
        admit(a, [9000 + i] * (P + 1))
        pub.publish()
        if sub.poll(100):
            return recv(sub)
    raise AssertionError("the subscriber never connected")


def feed_until_live(a, pub, feed):
    """Publish a page of ``a`` at a time until ``feed``'s subscription gets one (a SUB
    socket misses what is sent before it has connected)."""
    for attempt in range(50):
        admit(a, [8000 + attempt] * (P + 1))
        pub.publish()
        pub.flush(5)
        if feed.poll(100):
            return
    raise AssertionError("the subscription never received a batch")


def replay(endpoint, start):
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.connect(endpoint)
    try:
        d.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        for _ in range(100):
            frames = recv(d)
            assert frames[0] == b"" and len(frames) == 4
            if frames[2] == END:
                return out
            out.append(frames[1:])
        raise AssertionError("no end marker")
    finally:
        d.close(linger=0)


def test_frames_are_topic_sequence_and_a_decodable_batch():
    a = pool()
    with ZmqEventPublisher(a, LOOP, topic="kv") as pub:
        sub = sub_socket(pub.endpoint, b"kv")
        try:
            first = wait_subscribed(pub, sub, a)
            admit(a, np.arange(100, 109))
            assert pub.publish() == 2
            topic, seq, payload = recv(sub)
            assert topic == b"kv" and len(seq) == 8
            assert int.from_bytes(seq, "big") == int.from_bytes(first[1], "big") + 1
            (ev,) = schema.decoder().decode(payload).events
            assert ev.token_ids == list(range(100, 108)) and len(ev.block_hashes) == 2
        finally:
            sub.close(linger=0)
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish()


def test_replay_after_a_dropped_subscriber():
    a = pool()
    pub = ZmqEventPublisher(a, LOOP, replay_endpoint=LOOP, buffer_steps=8)
    try:
        sub = sub_socket(pub.endpoint)
        _, seq0, _ = wait_subscribed(pub, sub, a)
        last_seen = int.from_bytes(seq0, "big")
        sub.close(linger=0)  # the subscriber drops out ...
        sent = []
        for i in range(3):  # ... and misses three batches
            admit(a, np.arange(200 + 10 * i, 209 + 10 * i))
            assert pub.publish() == 2
            sent.append(pub.next_seq - 1)
        assert pub.flush(5)
        got = replay(pub.replay_endpoint, last_seen + 1)
        assert [int.from_bytes(s, "big") for _, s, _ in got] == sent
        toks = [schema.decoder().decode(p).events[0].token_ids[:1] for _, _, p in got]
        assert toks == [[200], [210], [220]]
        assert replay(pub.replay_endpoint, pub.next_seq) == [], "nothing newer: just the end marker"
    finally:
        pub.close()


def test_replay_without_the_topic_frame_answers_as_sglang_does():
    """SGLang's replay service (and vLLM's before its answers carried the topic) sends
    ``(b"", seq, payload)`` and ends with ``(b"", seq -1, b"")``; subscribers built on it
    unpack those frames."""
    a = pool()
    pub = ZmqEventPublisher(a, LOOP, replay_endpoint=LOOP, topic="kv", replay_topic_frame=False)
    d = zmq.Context.instance().socket(zmq.DEALER)
    try:
        admit(a, np.arange(200, 209))
        assert pub.publish() == 2 and pub.flush(5)
        d.connect(pub.replay_endpoint)
        d.send_multipart((b"", (0).to_bytes(8, "big")))
        first, end = recv(d), recv(d)
        assert len(first) == 3 and first[0] == b"" and int.from_bytes(first[1], "big") == 0
        assert schema.decoder().decode(first[2]).events[0].token_ids[:1] == [200]
        assert end == [b"", END, b""]
    finally:
        d.close(linger=0)
        pub.close()


def test_router_over_zmq_fills_a_gap_by_replay_and_forgets_a_pool_when_it_cannot():
    pools = [pool(), pool()]
    pubs = [ZmqEventPublisher(p, LOOP, replay_endpoint=LOOP, buffer_steps=2) for p in pools]
    router = Router(2, page_size=P, hash_seed=SEED)
    feed = ZmqFeed(router, replay_timeout_ms=2000)
    try:
        for i, pub in enumerate(pubs):
            feed.subscribe(i, pub.endpoint, replay_endpoint=pub.replay_endpoint)
        prompt = np.arange(300, 313)
        for attempt in range(50):  # until both subscriptions are live and a batch got through
            admit(pools[0], [7000 + attempt] * (P + 1))
            admit(pools[1], [7000 + attempt] * (P + 1))
            for pub in pubs:
                pub.publish()
                pub.flush(5)
            feed.poll(100)
            if all(s.next_seq is not None for s in router.streams):
                break
        admit(pools[1], prompt)
        pubs[1].publish()
        pubs[1].flush(5)
        deadline = time.monotonic() + 5
        while router.match(prompt)[1] == 0 and time.monotonic() < deadline:
            feed.poll(50)
        assert router.match(prompt) == [0, 12]
        assert router.route(prompt).pool == 1
        # Pool 0's next batch is lost on the way (sent, never received): the
        # gap is filled from its replay service.
        admit(pools[0], prompt)
        feed_sub = next(s for s, p in feed._subs.items() if p == 0)
        feed._poller.unregister(feed_sub)
        pubs[0].publish()
        pubs[0].flush(5)
        time.sleep(0.2)
        while feed_sub.poll(0):
            feed_sub.recv_multipart()  # dropped
        feed._poller.register(feed_sub, zmq.POLLIN)
        pools[0].evict(1)  # a later batch (the oldest probe page's Removed) shows the gap
        pubs[0].publish()
        pubs[0].flush(5)
        deadline = time.monotonic() + 5
        while router.match(prompt)[0] != 12 and time.monotonic() < deadline:
            feed.poll(50)
        assert router.match(prompt) == [12, 12], "the lost Stored batch came back by replay"
        assert router.streams[0].resets == 0 and feed.replays >= 1
        # Now lose more batches than the publisher keeps (buffer_steps=2): the
        # router cannot know what was removed, so it forgets pool 0.
        feed._poller.unregister(feed_sub)
        for i in range(3):
            admit(pools[0], np.arange(400 + 10 * i, 409 + 10 * i))
            pubs[0].publish()
        pubs[0].flush(5)
        time.sleep(0.2)
        while feed_sub.poll(0):
            feed_sub.recv_multipart()
        feed._poller.register(feed_sub, zmq.POLLIN)
        admit(pools[0], np.arange(500, 509))
        pubs[0].publish()
        pubs[0].flush(5)
        deadline = time.monotonic() + 5
        while router.streams[0].resets == 0 and time.monotonic() < deadline:
            feed.poll(50)
        assert router.streams[0].resets == 1
        assert router.match(prompt)[0] == 0, "pool 0 forgotten: no page of it is believed"
        assert router.match(np.arange(500, 509))[0] == 8, "relearned from the batches after the gap"
    finally:
        feed.close()
        for pub in pubs:
            pub.close()



def _restart_fleet(with_replay):
    """A router subscribed to publisher A, which has published a few batches
    the router applied; then A goes away (its engine stops). Returns the
    router, its feed, A's endpoints and the number the router expects next."""
    a = pool()
    pub = ZmqEventPublisher(a, LOOP, replay_endpoint=LOOP if with_replay else None)
    router = Router(1, page_size=P, hash_seed=SEED)
    feed = ZmqFeed(router, replay_timeout_ms=2000)
    feed.subscribe(0, pub.endpoint, replay_endpoint=pub.replay_endpoint)
    feed_until_live(a, pub, feed)
    admit(a, OLD)
    pub.publish()
    pub.flush(5)
    deadline = time.monotonic() + 5
    while router.match(OLD)[0] == 0 and time.monotonic() < deadline:
        feed.poll(50)
    assert router.match(OLD) == [8]
    expected = router.streams[0].next_seq
    endpoints = ("tcp://*:" + pub.endpoint.rsplit(":", 1)[1], pub.replay_endpoint)
    pub.close()
    deadline = time.monotonic() + 2
    while getattr(feed, "disconnects", 0) == 0 and time.monotonic() < deadline:
        feed.poll(50)
    return router, feed, endpoints, expected


OLD, NEW = np.arange(300, 309), np.arange(700, 709)


@pytest.mark.parametrize("with_replay", [True, False], ids=["replay", "no-replay"])
def test_a_restarted_engine_resuming_at_the_expected_number_is_not_believed(with_replay):
    """The engine restarts on the same endpoints with an empty cache, and its
    numbering reaches the router's next number before the SUB socket has
    reconnected: on the wire its next batch looks like the old stream's next.
    The router must not keep believing the old engine's pages."""
    router, feed, (endpoint, replay_endpoint), expected = _restart_fleet(with_replay)
    b = pool()
    pub = ZmqEventPublisher(b, endpoint, replay_endpoint=replay_endpoint if with_replay else None)
    try:
        for i in range(expected):  # sent before the subscriber is back: lost
            admit(b, [6000 + i] * (P + 1))
            assert pub.publish()
        pub.flush(5)
        time.sleep(0.5)  # the SUB socket reconnects (every 100 ms) and subscribes
        admit(b, NEW)
        assert pub.publish() == 2 and pub.next_seq == expected + 1
        pub.flush(5)
        deadline = time.monotonic() + 5
        while router.streams[0].batches == 0 or router.match(NEW)[0] == 0:
            feed.poll(50)
            if time.monotonic() > deadline:
                break
        assert router.match(NEW) == [8], "the new engine's stream is followed"
        assert router.match(OLD) == [0], "the old engine's pages went with it"
        assert router.streams[0].restarts == 1
    finally:
        feed.close()
        pub.close()


def test_a_subscriber_past_the_high_water_mark_catches_up_by_replay():
    """The router does not poll while the pool publishes far more batches than
    the PUB and SUB queues hold: ZMQ drops the excess, the router sees the gaps
    and fills them from the replay service, and ends up knowing exactly the
    pages the pool holds."""
    a = pool()
    pub = ZmqEventPublisher(a, LOOP, replay_endpoint=LOOP, hwm=10)
    router = Router(1, page_size=P, hash_seed=SEED)
    feed = ZmqFeed(router, replay_timeout_ms=2000)
    try:
        feed.subscribe(0, pub.endpoint, replay_endpoint=pub.replay_endpoint)
        feed_until_live(a, pub, feed)
        rng = np.random.default_rng(0)
        for _i in range(2500):
            admit(a, rng.integers(0, 1 << 20, size=2 * P + 1))
            assert pub.publish()
        assert pub.flush(5)
        deadline = time.monotonic() + 8
        while router.streams[0].next_seq != pub.next_seq and time.monotonic() < deadline:
            feed.poll(50)
        assert router.streams[0].next_seq == pub.next_seq, "caught up"
        assert feed.replays >= 1, "some batches were dropped and replayed"
        assert router.streams[0].resets == router.streams[0].restarts == 0
        assert router.pages(0) == a.cached_pages
    finally:
        feed.close()
        pub.close()


@pytest.mark.parametrize("call,match", [
    (lambda f: f.subscribe(0, "not an endpoint"), "endpoint"),
    (lambda f: f.subscribe(0, "tcp://127.0.0.1:1", replay_endpoint="nope://x"), "replay_endpoint"),
    (lambda f: f.subscribe(0, 5557), "endpoint"),
    (lambda f: f.subscribe(0, "tcp://127.0.0.1:1", topic=b"kv"), "topic"),
    (lambda f: f.subscribe(2, "tcp://127.0.0.1:1"), "pool"),
    # Were: connected to the port modulo 65536 (the publisher refuses such a port), and
    # a UnicodeEncodeError with a socket left open.
    (lambda f: f.subscribe(0, "tcp://127.0.0.1:99999"), "port '99999'"),
    (lambda f: f.subscribe(0, "tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:70000"), "port '70000'"),
    (lambda f: f.subscribe(0, "tcp://127.0.0.1:1", topic="\ud800"), "topic"),
    # a port of non-ASCII digits: '²' raised int()'s untyped ValueError.
    (lambda f: f.subscribe(0, "tcp://127.0.0.1:\u00b2"), "port '\u00b2'"),
    (lambda f: f.subscribe(0, "tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:\u0663"), "port '\u0663'"),
], ids=["bad-endpoint", "bad-replay-endpoint", "endpoint-int", "topic-bytes", "pool-out-of-range", "port-too-big",
        "replay-port-too-big", "topic-lone-surrogate", "port-superscript", "replay-port-arabic-indic"])
def test_bad_subscriptions_are_typed_and_leave_the_feed_as_it_was(call, match):
    feed = ZmqFeed(Router(2, page_size=P, hash_seed=SEED))
    try:
        with pytest.raises(kvpool.InvalidArgumentError, match=match):
            call(feed)
        assert not feed._subs and not feed._replay and not feed._monitors
        feed.subscribe(0, "tcp://127.0.0.1:1")
        with pytest.raises(kvpool.InvalidArgumentError, match="already"):
            feed.subscribe(0, "tcp://127.0.0.1:2")  # two streams into one pool would interleave
        assert len(feed._subs) == 1
    finally:
        feed.close()


@pytest.mark.parametrize("value", [-1, 1.5, True, "10"])
def test_bad_replay_timeouts_are_typed(value):
    with pytest.raises(kvpool.InvalidArgumentError, match="replay_timeout_ms"):
        ZmqFeed(Router(1, page_size=P, hash_seed=SEED), replay_timeout_ms=value)


def rebind_endpoints(kind: str, tmp_path, name: str) -> tuple[str, str]:
    """(publish, replay) addresses of one transport that a publisher can bind again and again."""
    if kind == "inproc":
        return f"inproc://kvpool-{name}-pub", f"inproc://kvpool-{name}-rep"
    if kind == "ipc":
        return f"ipc://{tmp_path}/pub.ipc", f"ipc://{tmp_path}/rep.ipc"
    probe = ZmqEventPublisher(pool(), "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    # Two ports free a moment ago; the PUB one with a wildcard host, which binds (a named
    # host's endpoint is connected to, and would not test the rebind).
    pub_ep, rep_ep = "tcp://*:" + probe.endpoint.rsplit(":", 1)[1], probe.replay_endpoint
    probe.close()
    return pub_ep, rep_ep


@pytest.mark.parametrize("kind", ["inproc", "ipc", "tcp"])
def test_close_frees_its_addresses_for_a_publisher_made_again_at_once(kind, tmp_path):
    """An engine that rebuilds its publisher on the same addresses (a restart, a reconfigure)
    must be able to bind them right after close(): ZMQ closes sockets in its I/O thread, and
    before close() unbound and waited, one rebind in a few failed with EADDRINUSE."""
    pub_ep, rep_ep = rebind_endpoints(kind, tmp_path, "rebind")
    a = pool()
    for _ in range(100):
        pub = ZmqEventPublisher(a, pub_ep, replay_endpoint=rep_ep)
        admit(a, np.arange(8))
        pub.publish()
        pub.close()
