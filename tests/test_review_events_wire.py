"""Outside checks of the KV event surfaces (review 38): driven through the public API
with their own traces, and decoded with the routers' own definitions."""

from typing import Any

import numpy as np
import pytest

import kvpool
from kvpool import _core

zmq = pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
msgspec = pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
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
        for _ in range(100):  # until the batch is through (a loaded machine is slow to forward it)
            fwd.pump()
            feed.poll(20)
            if router.match(prompt)[1] == 3 * P:
                break
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


# vLLM 0.33's classes (vllm/distributed/kv_events.py, read from the 0.33.0 wheel),
# re-declared here with their options and field order; the __hash__ methods left out.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Consumer:
    """A router's view built from the events alone, checking each as it applies it."""

    def __init__(self, page_size, int_hashes):
        self.P, self.ints = page_size, int_hashes
        self.held = {"GPU": set(), "CPU": set()}
        self.chain = {}  # hash -> (parent, tokens, salt), every hash ever stored
        self.dec = msgspec.msgpack.Decoder(KVEventBatch)
        self.seen = set()  # (event class, medium)

    def apply(self, payload):
        for ev in self.dec.decode(payload).events:
            self.seen.add((type(ev).__name__, getattr(ev, "medium", None)))
            if isinstance(ev, AllBlocksCleared):
                for s in self.held.values():
                    s.clear()
                continue
            held = self.held[ev.medium]
            if isinstance(ev, BlockRemoved):
                assert set(ev.block_hashes) <= held, "Removed names a page not stored in that tier"
                held.difference_update(ev.block_hashes)
                continue
            assert ev.block_size == self.P and len(ev.token_ids) == self.P * len(ev.block_hashes)
            assert ev.lora_id is None and ev.lora_name is None
            salt = int(ev.extra_keys[0][0]) if ev.extra_keys else 0
            parent = ev.parent_block_hash
            assert parent is None or parent in self.chain, "a parent hash never stored"
            for i, h in enumerate(ev.block_hashes):
                assert h not in held, "Stored twice in one tier without a Removed between"
                self.chain[h] = (parent, ev.token_ids[i * self.P:(i + 1) * self.P], salt)
                assert self.rehash(h) == h, "not the chain hash of the tokens and parents sent"
                held.add(h)
                parent = h

    def rehash(self, h):
        toks, salt = [], 0
        while h is not None:
            h, t, salt = self.chain[h]
            toks[:0] = t
        w = _core.page_hashes(np.array(toks, dtype=np.int64), self.P, SEED, salt)
        v = (int(w[-2]) << 64) | int(w[-1])
        return v & (2**64 - 1) if self.ints else v.to_bytes(16, "big")


REFUSED = (kvpool.PoolExhaustedError, kvpool.ContextTooLongError, kvpool.TooManyRequestsError,
           kvpool.RequestSwappedOutError, kvpool.InvalidArgumentError, kvpool.InvalidHandleError)


@pytest.mark.parametrize("page_size,host_pages,policy,int_hashes", [
    (1, 0, "write_back", False), (16, 0, "write_back", True),
    (1, 40, "write_through", True), (16, 24, "write_back", False)])
def test_vllm_classes_rebuild_the_pool_over_a_random_trace_and_refused_calls_emit_nothing(
        page_size, host_pages, policy, int_hashes):
    from kvpool.events import LocalEventPublisher

    Pg = page_size
    a = kvpool.SlotAllocator(40 if Pg == 16 else 200, Pg, 12, 48 * Pg, hash_seed=SEED, host_pages=host_pages,
                             host_policy=policy, max_pinned_pages=4)
    pub = LocalEventPublisher(a, int_block_hashes=int_hashes)
    view = Consumer(Pg, int_hashes)
    rng = np.random.default_rng(Pg + host_pages)
    stems = [rng.integers(0, 30, size=int(rng.integers(Pg, 5 * Pg))) for _ in range(4)]
    live, swapped = [], set()

    def call(fn, *args, **kw):
        """One pool call: its events are its own (drained before); a refused one has none."""
        for _, _, payload in pub.drain() if pub.publish() else []:
            view.apply(payload)
        try:
            return fn(*args, **kw)
        except REFUSED as e:
            assert len(a.take_events()["kind"]) == 0, f"a refused {fn.__name__} recorded events"
            raise e

    def pick():
        h = live[int(rng.integers(0, len(live)))]
        return None if h in swapped else np.array([h])

    for step in range(300):
        r = rng.random()
        try:
            if r < 0.3:
                prompt = np.concatenate([stems[int(rng.integers(0, 4))], rng.integers(0, 30, size=int(rng.integers(1, 2 * Pg)))])
                h, c = call(a.open_with_prefix, prompt, [len(prompt)], salt=int(rng.integers(0, 3)))
                live.append(int(h[0]))
                call(a.extend, h, len(prompt) - int(c[0]))
                call(a.cache, h, priority=100 if rng.random() < 0.1 else None)
            elif r < 0.4 and live and (h := pick()) is not None:
                n = int(rng.integers(1, 2 * Pg))
                call(a.extend, h, n, tokens=rng.integers(0, 30, size=n))
                call(a.cache, h)
            elif r < 0.47 and live and (h := pick()) is not None:
                live.extend(int(k) for k in call(a.fork, int(h[0]), 1))
            elif r < 0.54 and live and (h := pick()) is not None:
                call(a.truncate, h, int(rng.integers(0, int(a.length(int(h[0]))) + 1)))
            elif r < 0.72 and live:
                h = live.pop(int(rng.integers(0, len(live))))
                if h in swapped:
                    swapped.discard(h)
                    call(a.swap_in, np.array([h]))
                call(a.close, np.array([h]), cache=bool(rng.random() < 0.5))
            elif r < 0.8:
                call(a.evict, int(rng.integers(1, 6)))
            elif r < 0.86 and host_pages and live:
                h = live[int(rng.integers(0, len(live)))]
                call(a.swap_in if h in swapped else a.swap_out, np.array([h]))
                swapped.symmetric_difference_update({h})
            elif r < 0.9 and live:  # refused calls: an unknown handle, a duplicate, a bad priority
                for bad in (lambda: a.cache(np.array([live[0], live[0]])), lambda: a.evict(-1),
                            lambda: a.close(np.array([live[0]]), cache=True, priority=101),
                            lambda: a.truncate(np.array([live[0]]), 10**6)):
                    with pytest.raises(REFUSED):
                        call(bad)
            elif r < 0.905:
                call(a.clear_cache)
            elif r < 0.91:
                call(a.reset)
                live.clear()
                swapped.clear()
        except REFUSED:
            pass
        a.take_offloads()
        a.take_loads()
        a.take_copies()
        call(a.check)
        assert len(view.held["GPU"]) == a.cached_pages, step
        assert len(view.held["CPU"]) == a.host_cached_pages, step
    kinds = {("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("AllBlocksCleared", None)}
    if host_pages:
        kinds |= {("BlockStored", "CPU"), ("BlockRemoved", "CPU")}
    assert kinds <= view.seen, view.seen


def test_a_closed_feed_polls_nothing_and_can_subscribe_again():
    # close() closed the SUB sockets but left them registered with the poller:
    # every later poll() raised KeyError, even after a new subscribe().
    a = kvpool.SlotAllocator(64, P, 8, 256, hash_seed=SEED)
    router = Router(1, page_size=P, hash_seed=SEED)
    feed = ZmqFeed(router)
    with ZmqEventPublisher(a, LOOP) as pub:
        feed.subscribe(0, pub.endpoint)
        feed.close()
        assert feed.poll(0) == 0
        feed.subscribe(0, pub.endpoint)
        try:
            for attempt in range(100):
                admit(a, [7000 + attempt] * (P + 1))
                pub.publish()
                pub.flush(5)
                if feed.poll(20):
                    break
            assert router.pages(0) >= 1
        finally:
            feed.close()


def test_a_grouped_pool_hits_whole_hit_steps_while_the_router_counts_anchor_pages():
    # docs/events-and-metrics.md: full groups of pages 6 and 4 hit in steps of 12,
    # and the anchor chain the router reads has pages of 2.
    from kvpool.events import LocalEventPublisher

    a = kvpool.GroupedAllocator([{"kind": "full", "num_pages": 40, "page_size": 6},
                                 {"kind": "full", "num_pages": 60, "page_size": 4}], 8, 200, hash_seed=SEED)
    assert (a.hit_step, a.anchor_page_size) == (12, 2)
    pub = LocalEventPublisher(a)
    router = Router(1, page_size=2, hash_seed=SEED)
    prompt = np.arange(30, 41)  # 11 tokens: at most 10 can be hits
    h, _ = a.open_with_prefix(prompt, [len(prompt)])
    a.extend(h, len(prompt))
    a.close(h, cache=True)
    pub.publish()
    router.feed_many(0, pub.drain())
    assert router.match(prompt) == [10]
    _, cached = a.open_with_prefix(prompt, [len(prompt)])
    assert int(cached[0]) == 0


@pytest.mark.parametrize("buffer_steps", [2**30, 2**40])
def test_a_large_replay_buffer_is_accepted_with_a_replay_endpoint(buffer_steps):
    # buffer_steps is documented as any int in [0, 2**63); with a replay endpoint,
    # from 2**30 on it raised a bare OverflowError: the replay socket's send
    # high-water mark (2 * (buffer_steps + 1)) is a C int.
    a = kvpool.SlotAllocator(64, P, 8, 256, hash_seed=SEED)
    with ZmqEventPublisher(a, LOOP, replay_endpoint=LOOP, buffer_steps=buffer_steps) as pub:
        admit(a, np.arange(P + 1))
        assert pub.publish() == 1
        assert [s for _, s, _ in pub.replay(0)] == [(0).to_bytes(8, "big")]
