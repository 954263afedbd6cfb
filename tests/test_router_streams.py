"""kvpool.router's trust in sequence numbers: a restarted publisher (numbering
from 0 again, or resumed at the number the router expects next), a replayed
batch that is not the one applied under its number, and a bad root page in a
batch that waits behind a gap."""

import dataclasses

import numpy as np
import pytest

import kvpool

pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
from kvpool.events import LocalEventPublisher  # noqa: E402
from kvpool.router import Router  # noqa: E402

P, SEED = 4, 21
OLD, NEW = np.arange(100, 109), np.arange(500, 509)


def admit(a, tokens):
    tokens = np.asarray(tokens, dtype=np.int64)
    h, c = a.open_with_prefix(tokens, [len(tokens)])
    a.extend(h, len(tokens) - int(c[0]))
    a.close(h, cache=True)


def publisher(seed=SEED):
    return LocalEventPublisher(kvpool.SlotAllocator(64, P, 8, 512, hash_seed=seed))


def step(pub, tokens):
    admit(pub.pool, tokens)
    pub.publish()
    return pub.drain()


def router():
    return Router(1, page_size=P, hash_seed=SEED)


def test_a_publisher_restarted_from_seq_0_is_a_new_stream():
    """The engine restarted: its cache is empty and its numbering starts again.
    The router must drop what it believed of the old pool and take the new
    stream, not skip it as old duplicates."""
    r, old = router(), publisher()
    for i in range(3):
        r.feed_many(0, step(old, OLD + 1000 * i))
    assert r.match(OLD) == [8] and r.streams[0].next_seq == 3
    new = publisher()
    assert r.feed_many(0, step(new, NEW)) == 1
    assert r.match(OLD) == [0], "the restarted pool holds none of the old pages"
    assert r.match(NEW) == [8], "the new stream's pages are learned"
    assert r.streams[0].restarts == 1 and r.streams[0].duplicates == 0 and r.streams[0].next_seq == 1


def test_a_true_duplicate_is_still_ignored_and_changes_nothing():
    r, pub = router(), publisher()
    msgs = step(pub, OLD) + step(pub, NEW)
    r.feed_many(0, msgs)
    before = dataclasses.replace(r.streams[0], pending={})
    assert r.feed_many(0, msgs) == 0
    assert r.streams[0].duplicates == 2 and r.streams[0].restarts == 0
    assert dataclasses.replace(r.streams[0], duplicates=0) == dataclasses.replace(before, duplicates=0)
    assert r.match(OLD) == [8] and r.match(NEW) == [8]


def test_a_replayed_batch_that_differs_from_the_applied_one_is_a_restart():
    """What ZmqFeed's replay overlap checks: the publisher answers the last
    applied number with another batch, so its history is not the router's."""
    r, old = router(), publisher()
    r.feed_many(0, step(old, OLD))
    r.feed_many(0, step(old, OLD + 1000))
    new = publisher()
    step(new, np.arange(700, 709))
    msgs = step(new, NEW)  # the new publisher's seq 1: the old one's last applied number
    assert r.needs_replay(0) is None
    assert r.feed_many(0, msgs) == 1
    assert r.streams[0].restarts == 1
    assert r.match(OLD) == [0] and r.match(OLD + 1000) == [0] and r.match(NEW) == [8]


def test_verify_from_says_where_a_replay_overlap_starts():
    r, pub = router(), publisher()
    assert r.verify_from(0) is None, "nothing applied: nothing to check"
    r.feed_many(0, step(pub, OLD) + step(pub, NEW))
    assert r.verify_from(0) == 1, "the last applied batch"


def test_resync_forgets_the_pool_and_takes_the_next_batch_as_the_start():
    r, pub = router(), publisher()
    r.feed_many(0, step(pub, OLD))
    _ = step(pub, NEW + 1000)  # lost
    r.feed_many(0, step(pub, NEW))
    assert r.needs_replay(0) == 1
    r.resync(0)
    st = r.streams[0]
    assert st.next_seq is None and not st.pending and r.pages(0) == 0 and st.restarts == 1
    assert r.feed_many(0, step(pub, NEW + 2000)) == 1 and r.match(NEW + 2000) == [8]


def test_a_restarted_pool_with_another_seed_is_refused_and_the_stream_is_left_as_it_was():
    r, old = router(), publisher()
    r.feed_many(0, step(old, OLD))
    bad = publisher(seed=SEED + 1)
    (msg,) = step(bad, NEW)
    before = dataclasses.replace(r.streams[0], pending={})
    with pytest.raises(kvpool.InvalidArgumentError, match="hash_seed"):
        r.feed(0, *msg)
    assert r.streams[0] == before and r.match(OLD) == [8]


def test_a_bad_root_page_behind_a_gap_is_refused_at_once_and_leaves_the_stream_as_it_was():
    """The seed check runs when a batch arrives, not when it is applied: a batch
    that waits behind a gap and fails later would be lost half-applied, and the
    error would surface on another batch's feed()."""
    bad = publisher(seed=SEED + 1)
    step(bad, OLD)  # two pages
    bad.pool.evict(1)
    bad.publish()
    (m1,) = bad.drain()  # Removed only: no root page to check
    bad.pool.evict(1)
    bad.publish()
    (m2,) = bad.drain()  # Removed only
    (m3,) = step(bad, np.arange(900, 909))  # a root page hashed with the other seed
    r = router()
    r.feed(0, *m1)
    before = dataclasses.replace(r.streams[0], pending={})
    with pytest.raises(kvpool.InvalidArgumentError, match="hash_seed"):
        r.feed(0, *m3)
    assert r.streams[0] == before
    assert r.feed(0, *m2) == 1, "the batch in order still applies, and nothing fails behind it"


def _removed_batch(ts, tag):
    """A batch the router can apply without a seed check: one Removed event."""
    from kvpool.events import schema

    ev = schema.BlockRemoved(block_hashes=[tag.to_bytes(16, "big")], medium="GPU")
    return schema.msgspec.msgpack.encode(schema.KVEventBatch(ts=ts, events=[ev]))


def test_an_old_number_past_the_remembered_window_is_judged_by_its_timestamp():
    """A SUB queue drained after a replay caught up can hold batches far older
    than the payloads the router remembers: no newer than the last applied
    batch, they are stale copies; newer, they come from a restarted publisher."""
    from kvpool.router import event_streams as R

    r = router()
    n = R._REMEMBERED + 10
    for s in range(n):
        assert r.feed(0, b"", s.to_bytes(8, "big"), _removed_batch(1000.0 + s, s)) == 1
    assert 0 not in r.streams[0].applied, "seq 0 is past the window"
    assert r.feed(0, b"", (0).to_bytes(8, "big"), _removed_batch(1000.0, 0)) == 0
    assert r.streams[0].duplicates == 1 and r.streams[0].restarts == 0 and r.streams[0].next_seq == n
    assert r.feed(0, b"", (0).to_bytes(8, "big"), _removed_batch(5000.0, 1)) == 1
    assert r.streams[0].restarts == 1 and r.streams[0].next_seq == 1


def test_a_waiting_batch_replaced_by_another_under_its_number_is_a_restart():
    """Two different batches under one waiting number cannot come from one
    publisher: the stream restarted while the router waited on a gap."""
    r, old = router(), publisher()
    r.feed_many(0, step(old, OLD))
    _ = step(old, OLD + 1000)  # lost
    (waiting,) = step(old, OLD + 2000)
    assert r.feed(0, *waiting) == 0 and r.needs_replay(0) == 1
    new = publisher()
    step(new, np.arange(700, 709))
    step(new, np.arange(800, 809))
    (other,) = step(new, NEW)  # the new publisher's seq 2, the waiting number
    assert r.feed(0, *other) == 1
    st = r.streams[0]
    assert st.restarts == 1 and not st.pending and st.next_seq == 3
    assert r.match(OLD) == [0] and r.match(OLD + 2000) == [0] and r.match(NEW) == [8]


@pytest.mark.parametrize("change", [
    dict(extra_keys=[None]), dict(token_ids=[1]), dict(block_hashes=[]), dict(extra_keys=[(2**63,)]),
    dict(extra_keys=[()]), dict(extra_keys=[(str(2**63),)]), dict(extra_keys=[("7x",)]), dict(extra_keys=[("",)]),
], ids=["extra-keys-none", "too-few-tokens", "no-hashes", "salt-too-big", "extra-keys-empty", "str-salt-too-big",
      "str-salt-not-a-number", "str-salt-empty"])
def test_a_root_page_the_router_cannot_rehash_is_typed_and_changes_nothing(change):
    """A well-formed batch from a publisher that is not a kvpool pool (or a
    broken one) whose first root page cannot be rehashed is refused as
    InvalidArgumentError, not an IndexError or TypeError from inside feed()."""
    from kvpool.events import schema

    fields = dict(block_hashes=[b"\0" * 16], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=P,
                  lora_id=None, medium="GPU", lora_name=None)
    fields.update(change)
    payload = schema.msgspec.msgpack.encode(schema.KVEventBatch(ts=1.0, events=[schema.BlockStored(**fields)]))
    r = router()
    before = dataclasses.replace(r.streams[0], pending={})
    with pytest.raises(kvpool.InvalidArgumentError, match="root page"):
        r.feed(0, b"", (0).to_bytes(8, "big"), payload)
    assert r.streams[0] == before and r.pages(0) == 0
