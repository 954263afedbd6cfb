"""Block hashes in vLLM's int form (``int_block_hashes=True``): what vLLM sends by
default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the low 64 bits of the hash), so
that consumers typed against it decode kvpool's stream (SGLang's own event classes
among them), and a Router fed by such pools, or by a mix of both forms, predicts
what the pools serve."""

import numpy as np
import pytest

import kvpool
from kvpool import _core

msgspec = pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
from kvpool.events import LocalEventPublisher, schema
from kvpool.router import Router

P, SEED = 4, 5
LOW64 = (1 << 64) - 1


def pool(pages=32):
    return kvpool.SlotAllocator(pages, P, 8, 256, hash_seed=SEED)


def admit(a, tokens, salt=0, close=True):
    tokens = np.asarray(tokens, dtype=np.int64)
    h, c = a.open_with_prefix(tokens, [len(tokens)], salt=salt)
    a.extend(h, len(tokens) - int(c[0]))
    a.cache(h)
    if close:
        a.close(h)
    return int(c[0])


def traffic(a):
    """Stored chains (two salts, one branching off a cached prefix), then evictions."""
    admit(a, np.arange(100, 113))
    admit(a, np.concatenate([np.arange(100, 108), [7, 7, 7, 7, 7]]))
    admit(a, np.arange(100, 109), salt=9)
    for i in range(12):  # more than the free pages: the first chains are evicted
        admit(a, np.arange(1000 * i, 1000 * i + 17))


def batch_of(payload):
    return msgspec.msgpack.Decoder(schema.KVEventBatch).decode(payload)


def test_the_int_form_is_the_low_64_bits_of_each_hash_and_parent():
    events = pool()
    traffic(events)
    drained = events.take_events()
    as_bytes = batch_of(_core.encode_kv_events(drained, 1.5)[0])
    payload, stored, removed, cleared = _core.encode_kv_events(drained, 1.5, int_block_hashes=True)
    as_ints = batch_of(payload)
    assert stored > 0 and removed > 0, "the trace stores and evicts"
    assert len(as_ints.events) == len(as_bytes.events)

    def low(h):  # vLLM's maybe_convert_block_hash
        return None if h is None else int.from_bytes(h, "big") & LOW64

    parents = 0
    for b, i in zip(as_bytes.events, as_ints.events):
        assert type(b) is type(i)
        if isinstance(b, schema.AllBlocksCleared):
            continue
        assert all(type(h) is int and 0 <= h <= LOW64 for h in i.block_hashes)
        assert i.block_hashes == [low(h) for h in b.block_hashes]
        if isinstance(b, schema.BlockStored):
            assert i.parent_block_hash == low(b.parent_block_hash)
            parents += b.parent_block_hash is not None
            assert (i.token_ids, i.block_size, i.extra_keys, i.medium) == (
                b.token_ids, b.block_size, b.extra_keys, b.medium)
    assert parents, "a chain that branches off a cached page names its parent"


def test_int_hashes_take_msgpacks_shortest_form_at_every_width():
    """The int form is written by index (no rmp call a page): each value in the shortest
    msgpack uint, the bytes msgspec writes for the same list."""
    values = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, 2**64 - 1]
    n = len(values)
    ev = {"kind": np.ones(n, np.uint8), "hash_hi": np.full(n, 7, np.uint64),
          "hash_lo": np.array(values, np.uint64), "parent_hi": np.zeros(n, np.uint64),
          "parent_lo": np.zeros(n, np.uint64), "page": np.arange(n, dtype=np.int32),
          "num_tokens": np.zeros(n, np.int32), "salt": np.zeros(n, np.int64),
          "token_ids": np.zeros(0, np.int32)}
    payload, stored, removed, cleared = _core.encode_kv_events(ev, 0.0, int_block_hashes=True)
    assert (stored, removed, cleared) == (0, n, 0)
    (event,) = msgspec.msgpack.decode(payload)[1]
    assert event["block_hashes"] == values
    assert msgspec.msgpack.encode(values) in payload


def test_take_events_msgpack_and_the_publishers_send_the_same_int_form():
    a, b = pool(), pool()
    traffic(a)
    traffic(b)
    want = _core.encode_kv_events(a.take_events(), 2.0, 3, int_block_hashes=True)
    assert b.take_events_msgpack(2.0, 3, int_block_hashes=True) == want
    c = pool()
    pub = LocalEventPublisher(c, int_block_hashes=True)
    assert pub.int_block_hashes is True
    traffic(c)
    pub.publish()
    (_, _, payload), = pub.drain()
    assert batch_of(payload).events == batch_of(want[0]).events


def test_sglangs_own_event_classes_decode_the_int_form_and_not_the_bytes():
    kv = pytest.importorskip("sglang.srt.disaggregation.kv_events", reason="SGLang is not installed")
    a = pool()
    traffic(a)
    drained = a.take_events()
    dec = msgspec.msgpack.Decoder(kv.KVEventBatch)
    with pytest.raises(msgspec.ValidationError):
        dec.decode(_core.encode_kv_events(drained, 1.0)[0])
    got = dec.decode(_core.encode_kv_events(drained, 1.0, int_block_hashes=True)[0])
    kinds = {type(e).__name__ for e in got.events}
    assert {"BlockStored", "BlockRemoved"} <= kinds
    stored = [e for e in got.events if isinstance(e, kv.BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == int((drained["kind"] == 0).sum())
    assert all(e.block_size == P and e.medium == "GPU" for e in stored)


def test_a_router_reads_int_hashes_and_a_fleet_that_mixes_both_forms():
    """Pool 0 sends 16-byte hashes, pool 1 ints: each prediction is the pool's own
    match, under eviction, and the seed check works on either form."""
    pools = [pool(24), pool(24)]
    pubs = [LocalEventPublisher(pools[0]), LocalEventPublisher(pools[1], int_block_hashes=True)]
    r = Router(2, page_size=P, hash_seed=SEED)
    rng = np.random.default_rng(0)
    stems = [rng.integers(0, 40, size=int(rng.integers(4, 30))) for _ in range(5)]
    for i in range(200):
        prompt = np.concatenate([stems[int(rng.integers(0, 5))], rng.integers(0, 40, size=int(rng.integers(1, 6)))])
        hashes = _core.page_hashes(prompt, P, SEED)
        n = min(len(hashes) // 2, (len(prompt) - 1) // P)
        truth = [P * a.match_chain_hashes(hashes[: 2 * n], prompt[: n * P]) for a in pools]
        assert r.match(prompt) == truth, i
        route = r.route(prompt, eligible=[i % 3 != 0, i % 3 != 1])  # both pools get traffic
        assert admit(pools[route.pool], prompt) == route.cached_tokens, i
        r.finished(route.pool)
        for k, pub in enumerate(pubs):
            pub.publish()
            r.feed_many(k, pub.drain())
    assert all(pub.removed_pages > 0 for pub in pubs), ("both pools evicted", [p.removed_pages for p in pubs])
    assert r.pages(0) and r.pages(1)
    # Only int pools: the router looks prompts up in that form alone.
    c = pool()
    pub = LocalEventPublisher(c, int_block_hashes=True)
    admit(c, np.arange(300, 313))
    pub.publish()
    only = Router(1, page_size=P, hash_seed=SEED)
    only.feed_many(0, pub.drain())
    assert only.match(np.arange(300, 313)) == [12] and only.match(np.arange(300, 305)) == [4]


def test_an_int_pool_with_another_seed_is_refused():
    a = kvpool.SlotAllocator(64, P, 8, 256, hash_seed=SEED + 1)
    pub = LocalEventPublisher(a, int_block_hashes=True)
    admit(a, np.arange(9))
    pub.publish()
    with pytest.raises(kvpool.InvalidArgumentError, match="hash_seed"):
        Router(1, page_size=P, hash_seed=SEED).feed_many(0, pub.drain())


@pytest.mark.parametrize("bad", [1, 0, None, "yes", 1.0], ids=repr)
def test_the_flag_takes_true_or_false_and_a_refusal_drains_nothing(bad):
    a = pool()
    admit(a, np.arange(9))
    with pytest.raises(kvpool.InvalidArgumentError, match="int_block_hashes"):
        a.take_events_msgpack(1.0, None, int_block_hashes=bad)
    with pytest.raises(kvpool.InvalidArgumentError, match="int_block_hashes"):
        _core.encode_kv_events(a.take_events(), 1.0, int_block_hashes=bad)
    with pytest.raises(kvpool.InvalidArgumentError, match="int_block_hashes"):
        LocalEventPublisher(a, int_block_hashes=bad)
    b = pool()
    admit(b, np.arange(9))
    with pytest.raises(kvpool.InvalidArgumentError):
        b.take_events_msgpack(1.0, None, int_block_hashes=bad)
    assert b.take_events_msgpack(1.0)[1] == 2, "the refused call left both Stored pages to drain"
    assert a.take_events_msgpack(1.0, int_block_hashes=np.bool_(True))[1] == 0


def test_the_zmq_publisher_takes_the_flag():
    pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
    from kvpool.events import ZmqEventPublisher

    a = pool()
    with pytest.raises(kvpool.InvalidArgumentError, match="int_block_hashes"):
        ZmqEventPublisher(a, "inproc://kvpool-int-hashes-bad", int_block_hashes="yes")
    with ZmqEventPublisher(a, "inproc://kvpool-int-hashes", int_block_hashes=True) as pub:
        admit(a, np.arange(9))
        assert pub.int_block_hashes and pub.publish() == 2
        (_, _, payload), = pub.replay(0)
        assert all(type(h) is int for e in batch_of(payload).events for h in e.block_hashes)


def test_a_hybrid_pools_events_take_the_int_form_with_their_group():
    """A KVPool with layer groups drains through take_events and encode_kv_events."""
    pool_ = kvpool.KVPool(2, 1, 8, page_size=P, num_pages=64, max_requests=8, max_context_len=512,
                          layer_types=["full_attention", "sliding_attention"], sliding_window=8, hash_seed=SEED)
    pub = LocalEventPublisher(pool_, int_block_hashes=True)
    admit(pool_, np.arange(13))
    assert pub.publish() > 0
    (_, _, payload), = pub.drain()
    stored = [e for e in batch_of(payload).events if isinstance(e, schema.BlockStored)]
    assert stored and all(type(h) is int for e in stored for h in e.block_hashes)
    r = Router(1, page_size=P, hash_seed=SEED)
    r.feed(0, b"", (0).to_bytes(8, "big"), payload)
    assert r.match(np.arange(13))[0] > 0
