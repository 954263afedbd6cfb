"""Bad input an outside checker would feed the newer public surfaces: the host tier's
transfer runner and storage, layer groups, the event publishers and the router.

Each case asserts the exact kvpool exception (never a TypeError / ValueError /
IndexError from numpy, torch or the standard library, and never a process that runs
out of memory), a message that says what would be right, and that the object it was
called on is unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
from kvpool import InvalidArgumentError, KVPoolError, LayerIndexError
from kvpool.errors import TensorShapeError
from kvpool.tiers import HostStorage, TransferRunner


def tiered_pool() -> kvpool.KVPool:
    pool = kvpool.KVPool(2, 2, 4, dtype=torch.float16, num_pages=8, page_size=2, max_requests=4,
                         max_context_len=8, host_pages=5)
    gen = torch.Generator().manual_seed(0)
    for t in pool._storage.caches + [pool.host.buffer]:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return pool


def raw(pool: kvpool.KVPool) -> list[bytes]:
    return [t.contiguous().view(torch.uint8).numpy().tobytes() for t in pool._storage.caches + [pool.host.buffer]]


# ----- TransferRunner / TransferBatch / HostStorage ------------------------------------------

RAGGED = [[1], [2, 3]]
RUNNER_CASES = [
    ("offloads ragged device pages", dict(offloads=(RAGGED, [1, 2]))),
    ("offloads ragged host pages", dict(offloads=([1, 2], RAGGED))),
    ("loads ragged", dict(loads=(RAGGED, [1, 2]))),
    ("copies ragged", dict(copies=(RAGGED, [4, 5]))),
    ("copies ragged after a valid offload", dict(offloads=([1], [1]), copies=([2, 3], RAGGED))),
]


@pytest.mark.parametrize("name,kw", RUNNER_CASES, ids=[c[0] for c in RUNNER_CASES])
def test_a_ragged_id_list_is_a_typed_refusal_and_moves_nothing(name, kw):
    pool = tiered_pool()
    before = raw(pool)
    with pytest.raises(KVPoolError) as info:
        pool._transfers.run(**kw)
    assert type(info.value) is TensorShapeError, f"{name}: {type(info.value).__name__}: {info.value}"
    assert "1-D" in str(info.value) or "flat" in str(info.value), str(info.value)
    assert raw(pool) == before


@pytest.mark.parametrize("caches", [[], (), [torch.zeros(4)], None, 3], ids=str)
def test_a_runner_without_caches_is_refused_when_built(caches):
    host = HostStorage(4, num_layers=2, page_size=2, heads=2, head_dim=4, dtype=torch.float16)
    with pytest.raises(InvalidArgumentError, match="caches"):
        TransferRunner(caches, host, "cpu")


def test_a_runner_device_that_is_not_a_device_is_refused_when_built():
    pool = tiered_pool()
    with pytest.raises(InvalidArgumentError, match="device"):
        TransferRunner(pool._storage.caches, pool.host, "bogus")


def test_wait_layer_takes_a_layer_of_the_batch():
    from test_tier_transfers import FakeStreams

    pool = tiered_pool()
    fake = FakeStreams()
    runner = TransferRunner.for_pool(pool, pool.host, streams=fake)
    batch = runner.run(loads=([1], [2]), layered=True)
    assert len(batch.layer_events) == 2
    for bad in (2, -1, "0", 1.0, None, True):
        log = len(fake.log)
        with pytest.raises(LayerIndexError, match=r"\[0, 2\)"):
            batch.wait_layer(bad)
        assert len(fake.log) == log  # nothing waited
    batch.wait_layer(np.int64(1))
    assert fake.log[-1] == f"compute.wait_event({batch.layer_events[1].name})"
    # A batch that ran at once (CPU) has no layers to wait for, but a wrong kind of
    # layer is still wrong.
    cpu_batch = pool._transfers.run()
    cpu_batch.wait_layer(0)
    with pytest.raises(LayerIndexError):
        cpu_batch.wait_layer("0")


@pytest.mark.parametrize("bad", ["1", None, 1.5, np.float64(1.0), True, np.array([1])], ids=repr)
def test_host_storage_page_takes_an_int(bad):
    host = HostStorage(4, num_layers=2, page_size=2, heads=2, head_dim=4, dtype=torch.float16)
    with pytest.raises(InvalidArgumentError, match=r"host page .*\[0, 4\)"):
        host.page(bad)
    assert host.page(np.int64(3)).data_ptr() == host.buffer[3].data_ptr()


# ----- GroupedAllocator -----------------------------------------------------------------------

FULL = {"kind": "full", "num_pages": 8, "page_size": 2}


@pytest.mark.parametrize("num_slots", [0, 1, 2**40])
def test_a_state_group_size_error_names_num_slots(num_slots):
    with pytest.raises(InvalidArgumentError, match=r"num_slots must be in \[2, ") as info:
        kvpool.GroupedAllocator([FULL, {"kind": "state", "num_slots": num_slots}])
    assert "num_pages" not in str(info.value)


def test_a_group_that_does_not_exist_names_the_groups_that_do():
    a = kvpool.GroupedAllocator([FULL, {"kind": "sliding", "num_pages": 8, "page_size": 2, "window": 4},
                                 {"kind": "state", "num_slots": 4}])
    h = a.open(1)
    for call in (lambda: a.evict(3, 1), lambda: a.slots(h[0], 3), lambda: a.free_pages(3)):
        with pytest.raises(InvalidArgumentError) as info:
            call()
        msg = str(info.value)
        assert "group 3 does not exist" in msg and "0 to 2" in msg, msg
    a.check()


# ----- kvpool.events --------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["0", None, 1.5, True, b"\0" * 8, np.array([0])], ids=repr)
def test_replay_takes_an_int_sequence_number(bad):
    from kvpool.events import LocalEventPublisher

    pool = kvpool.KVPool(2, 2, 4, num_pages=8, page_size=2)
    pub = LocalEventPublisher(pool)
    h, _ = pool.open_with_prefix([1, 2, 3, 4, 5], [5])
    pool.extend(h, 5)
    pool.cache(h)
    assert pub.publish() == 2
    with pytest.raises(InvalidArgumentError, match="start_seq"):
        pub.replay(bad)
    assert len(pub.replay(np.int64(0))) == len(pub.replay(-3)) == 1 and pub.replay(1) == []


# ----- kvpool.router --------------------------------------------------------------------------

@pytest.mark.parametrize("num_pools", [2**17, 2**40, 2**62])
def test_a_router_over_more_pools_than_it_can_index_is_refused_before_allocating(num_pools):
    from kvpool.router import Router

    with pytest.raises(InvalidArgumentError, match=r"num_pools must be an int in \[1, 65536\]"):
        Router(num_pools, page_size=2, hash_seed=1)
    assert Router(65536, page_size=2, hash_seed=1).num_pools == 65536


@pytest.mark.parametrize("tokens", [np.array([1.5]), np.array([1.5, 2.5]), [0.5, 1.0], np.array(["a", "b"])],
                         ids=repr)
def test_match_refuses_token_ids_that_are_not_ints_at_any_length(tokens):
    from kvpool.router import Router

    r = Router(2, page_size=2, hash_seed=1)
    with pytest.raises(InvalidArgumentError, match="integer"):
        r.match(tokens)
    with pytest.raises(InvalidArgumentError, match="integer"):
        r.route(tokens)
    assert r.load == [0, 0]


def test_a_publisher_of_a_hybrid_pool_reports_its_dropped_events():
    from kvpool.events import LocalEventPublisher

    pool = kvpool.KVPool(2, 2, 4, num_pages=16, page_size=2, layer_types=["full_attention", "sliding_attention"],
                         sliding_window=4)
    pub = LocalEventPublisher(pool)
    h, _ = pool.open_with_prefix(list(range(1, 10)), [9])
    pool.extend(h, 9)
    pool.cache(h)
    assert pub.publish() == 4
    assert pub.dropped_events == pool.allocator.dropped_events == 0


# ----- HybridKVPool off the CPU -----------------------------------------------------------------

@pytest.mark.parametrize("bad", ["x", None, [2**64], [[1], [2, 3]], "float"], ids=repr)
def test_hybrid_extend_off_the_cpu_checks_handles_before_converting_them(bad):
    """Off the CPU the pool scatters the new slots itself, converting the handles to int64
    first: that conversion must not see handles the core has not checked (numpy's
    ValueError / TypeError / OverflowError, or float handles rounded into other ones).
    The CPU pool runs the same path with its numpy tables switched off."""
    pool = kvpool.KVPool(4, 2, 8, layer_types=["sliding_attention", "full_attention", "linear_attention",
                                               "sliding_attention"], sliding_window=8, state_shapes={"conv": (6, 4)},
                         dtype=torch.float32, page_size=4, num_pages=64, max_requests=4, max_context_len=32)
    pool._tables_np = None  # the path a CUDA pool takes
    h = pool.open(2)
    pool.extend(h, [5, 9])
    if bad == "float":
        bad = h.astype(np.float64)
    before = ([pool.free_pages(layer) for layer in range(4) if layer != 2], pool.lengths(h).tolist(),
              [t.clone() for t in pool._tables if t is not None])
    with pytest.raises(InvalidArgumentError) as info:
        pool.extend(bad, 1)
    assert "handle" in str(info.value) and "more than once" not in str(info.value), str(info.value)
    after = ([pool.free_pages(layer) for layer in range(4) if layer != 2], pool.lengths(h).tolist(),
             [t.clone() for t in pool._tables if t is not None])
    assert after[:2] == before[:2] and all(torch.equal(x, y) for x, y in zip(after[2], before[2]))
    pool.check()


# ----- ZMQ publisher and feed -----------------------------------------------------------------

def test_zmq_publisher_socket_options_are_checked_before_anything_is_made():
    pytest.importorskip("zmq")
    from kvpool.events import ZmqEventPublisher

    pool = kvpool.KVPool(2, 2, 4, num_pages=8, page_size=2)
    with pytest.raises(InvalidArgumentError, match=r"hwm must be an int in \[0, 2147483647\]"):
        ZmqEventPublisher(pool, "inproc://review-hwm", hwm=2**40)
    with pytest.raises(InvalidArgumentError, match="context must be None or a zmq.Context"):
        ZmqEventPublisher(pool, "inproc://review-ctx", context=object())
    # Neither refusal kept the endpoint: it binds now.
    ZmqEventPublisher(pool, "inproc://review-hwm", hwm=2**31 - 1).close()


def test_zmq_feed_takes_a_router_and_timeouts_zmq_can_wait():
    pytest.importorskip("zmq")
    from kvpool.router import Router, ZmqFeed

    with pytest.raises(InvalidArgumentError, match="router must be a kvpool.router.Router"):
        ZmqFeed(None)
    r = Router(2, page_size=2, hash_seed=1)
    with pytest.raises(InvalidArgumentError, match=r"replay_timeout_ms must be an int in \[0, 2147483647\]"):
        ZmqFeed(r, replay_timeout_ms=2**40)
    with pytest.raises(InvalidArgumentError, match=r"context must be None or a zmq.Context"):
        ZmqFeed(r, context=object())
    feed = ZmqFeed(r)
    try:
        # (negative ones were handed to ZMQ, which waits on them for ever: poll(-1) never returned)
        for bad in ("x", 2**40, True, float("nan"), -1, -0.5, float("-inf")):
            with pytest.raises(InvalidArgumentError, match="timeout_ms"):
                feed.poll(bad)
        assert feed.poll(0) == feed.poll(1.5) == 0
    finally:
        feed.close()


@pytest.mark.parametrize("kw", [dict(loads=np.array(1.0)), dict(loads=torch.tensor(1.0)), dict(eligible=np.array(True)),
                                dict(loads={0: 5, 1: 0}), dict(eligible={0: False, 1: True}), dict(loads={5, 0})],
                         ids=lambda kw: f"{next(iter(kw))}={next(iter(kw.values()))!r}")
def test_route_per_pool_arguments_are_sequences(kw):
    """A 0-d array has ``__len__`` but no length (TypeError), and a dict's keys are not its
    loads (its values are): both are refused before the route is counted."""
    from kvpool.router import Router

    r = Router(2, page_size=2, hash_seed=1)
    with pytest.raises(InvalidArgumentError, match=r"sequence of 2 entries"):
        r.route([1, 2, 3], **kw)
    assert r.load == [0, 0]
    assert r.route([1, 2, 3], loads=np.array([5.0, 0.0])).pool == 1


# ----- HybridKVPool construction and state -----------------------------------------------------

HYBRID = dict(layer_types=["sliding_attention", "full_attention", "linear_attention", "sliding_attention"],
              sliding_window=8, state_shapes={"conv": (6, 4)}, dtype=torch.float32, page_size=4, num_pages=64,
              max_requests=4, max_context_len=32)


@pytest.mark.parametrize("page_size", [{"moe": 4}, {"sliding": 2, "full_attention": 4},
                                       {"full_attention": 4, "sliding_attention ": 2}], ids=repr)
def test_a_page_size_dict_names_only_the_pools_layer_types(page_size):
    """As group_pages: a key that is no layer type of the pool (a typo) was ignored, and
    the group it meant got page size 1."""
    with pytest.raises(InvalidArgumentError, match=r"page_size names .* not among layer_types"):
        kvpool.KVPool(4, 2, 8, **(HYBRID | {"page_size": page_size}))
    pool = kvpool.KVPool(4, 2, 8, **(HYBRID | {"page_size": {"sliding_attention": 2, "full_attention": 4}}))
    assert pool.page_size_of(0) == 2 and pool.page_size_of(1) == 4


@pytest.mark.parametrize("name", [["conv"], {"conv": 1}, None, 1], ids=repr)
def test_state_takes_a_state_name(name):
    pool = kvpool.KVPool(4, 2, 8, **HYBRID)
    with pytest.raises(InvalidArgumentError, match=r"state_shapes has \['conv'\]"):
        pool.state(2, name)


@pytest.mark.parametrize("args,name", [
    (("2", 2, 2, 4, torch.float16), "num_layers"),      # was "2" * 64: a 64-character str
    ((-2, 2, 2, 4, torch.float16), "num_layers"),       # was -128 bytes
    ((2, 0, 2, 4, torch.float16), "page_size"),
    ((2, 2, 2.5, 4, torch.float16), "heads"),
    ((2, 2, 2, True, torch.float16), "head_dim"),
    ((2, 2, 2, 4, "float16"), "dtype"),                 # was AttributeError
    ((2, 2, 2, 4, None), "dtype"),
    ((2, 2, 2, 4, torch.int64), "dtype"),
], ids=repr)
def test_host_page_bytes_checks_its_sizes(args, name):
    from kvpool.tiers import host_page_bytes

    with pytest.raises(InvalidArgumentError, match=name):
        host_page_bytes(*args, mla=False)
    assert host_page_bytes(2, 2, 2, 4, torch.float16, mla=False) == 2 * 2 * 2 * 2 * 4 * 2


def _router_messages(hash_seed: int) -> list[tuple[bytes, bytes, bytes]]:
    from kvpool.events import LocalEventPublisher

    pool = kvpool.KVPool(2, 2, 4, num_pages=16, page_size=2, hash_seed=hash_seed)
    pub = LocalEventPublisher(pool)
    for prompt in ([1, 2, 3, 4, 5], [7, 8, 9]):
        h, _ = pool.open_with_prefix(prompt, [len(prompt)])
        pool.extend(h, len(prompt))
        pool.cache(h)
        pub.publish()
    return pub.drain()


@pytest.mark.parametrize("bad", ["payload", "seq", "seed"])
def test_feed_many_with_a_bad_message_after_good_ones_applies_none(bad):
    from kvpool.router import Router

    good = _router_messages(hash_seed=1)
    # "seed": another pool's first batch under a number already applied (a restart), whose
    # root is hashed with another seed: refused by the seed check, after good[0] applied.
    topic, seq, payload = _router_messages(hash_seed=1 if bad != "seed" else 2)[1 if bad != "seed" else 0]
    if bad == "payload":
        payload = payload[:-3]
    elif bad == "seq":
        seq = seq[:4]
    r = Router(1, page_size=2, hash_seed=1)
    with pytest.raises(InvalidArgumentError):
        r.feed_many(0, [good[0], (topic, seq, payload)])
    st = r.streams[0]
    assert (r.pages(0), st.next_seq, st.batches, st.checked_seed, len(r.index)) == (0, None, 0, False, 0)
    assert r.feed_many(0, good) == 2 and r.pages(0) == 3
    with pytest.raises(InvalidArgumentError, match="pool must be an int"):
        r.feed_many(1, [])
