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
