"""Outside-style sweep of kvpool.router: inputs a serving router meets that the
other router tests do not cover."""

import pytest

pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
from kvpool import KVPoolError  # noqa: E402
from kvpool.router import Router  # noqa: E402


def test_loads_may_be_ints_past_floats_range():
    # An int load past float's range (a byte count, a summed token budget) made
    # math.isnan raise OverflowError, an untyped error; ints have no NaN and compare
    # with floats exactly, so it is simply the largest load.
    r = Router(3, page_size=2, hash_seed=1)
    assert r.route([1, 2, 3], loads=[10**400, 5, 10**400]).pool == 1
    assert r.route([1, 2, 3], loads=[10**400, 10**400 - 1, float("inf")]).pool == 1
    assert r.load == [0, 2, 0]
    with pytest.raises(KVPoolError, match=r"loads\[1\] must be a number"):
        r.route([1, 2, 3], loads=[10**400, float("nan"), 0])
    assert r.load == [0, 2, 0], "a refused route counts no request"


def _root_batch(token_ids):
    import msgspec

    from kvpool.events.schema import BlockStored, KVEventBatch
    ev = BlockStored(block_hashes=[b"x" * 16], parent_block_hash=None, token_ids=token_ids, block_size=2,
                     lora_id=None, medium="GPU", lora_name=None, extra_keys=[(0,)])
    return msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[ev], data_parallel_rank=0))


def test_a_root_page_with_bad_token_ids_is_refused_as_that_messages_fault():
    # The root-page check rehashes the event's token ids; page_hashes' own refusal
    # ("tokens[0] = -1 is not a token id") reached the caller of feed() without
    # saying which pool or message it was about.
    r = Router(2, page_size=2, hash_seed=1)
    for toks in ([-1, 2], [2**40, 2]):
        with pytest.raises(KVPoolError, match=r"pool 1's root page has token ids no pool stores: tokens\[0\]"):
            r.feed(1, b"", (0).to_bytes(8, "big"), _root_batch(toks))
    assert r.streams[1].next_seq is None and r.pages(1) == 0, "the stream is left as it was"


def test_numpy_int_settings_route_like_python_ints():
    # Router(np.int64(n), ...) passed the checks but kept the numpy int: the pool
    # bitmask became a numpy int64, match() raised AttributeError (no bit_length),
    # and past 63 pools the mask would wrap.
    np = pytest.importorskip("numpy")
    import kvpool
    from kvpool.events import LocalEventPublisher

    for n in (3, 70):
        r = Router(np.int64(n), page_size=np.int64(2), hash_seed=np.uint64(5), max_pending=np.int32(4))
        a = kvpool.SlotAllocator(16, 2, 4, 64, hash_seed=5)
        pub = LocalEventPublisher(a)
        t = np.arange(1, 8)
        h, c = a.open_with_prefix(t, [7])
        a.extend(h, 7)
        a.close(h, cache=True)
        pub.publish()
        r.feed_many(np.int64(n - 1), pub.drain())
        assert r.match(t) == [0] * (n - 1) + [6]
        route = r.route(t)
        assert (route.pool, route.cached_tokens) == (n - 1, 6)
        assert type(route.cached_tokens) is int


def test_a_signed_int64_root_hash_is_refused_as_signed_not_as_another_seed():
    # The same 64 bits sent signed (SGLang's own producer form) were refused with "build the
    # router with the pools' hash_seed", sending the operator after the wrong setting.
    import msgspec
    import numpy as np

    from kvpool._core import page_hashes
    from kvpool.events.schema import BlockStored, KVEventBatch

    seed = 5  # the first seed from 5 whose root hash is negative when read as int64
    while int(page_hashes(np.array([7, 7]), 2, seed, 0)[1]) < 1 << 63:
        seed += 1
    u = int(page_hashes(np.array([7, 7]), 2, seed, 0)[1])
    r = Router(1, page_size=2, hash_seed=seed)
    for h, ok in ((u - (1 << 64), False), (u, True)):
        ev = BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[7, 7], block_size=2,
                         lora_id=None, medium="GPU", lora_name=None, extra_keys=[(0,)])
        payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[ev], data_parallel_rank=0))
        if ok:
            r.feed(0, b"", (0).to_bytes(8, "big"), payload)
            assert r.match([7, 7, 7]) == [2]
        else:
            with pytest.raises(KVPoolError, match="signed int64"):
                r.feed(0, b"", (0).to_bytes(8, "big"), payload)
            assert r.pages(0) == 0 and r.streams[0].next_seq is None
