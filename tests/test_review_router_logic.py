"""Outside-check review of the router's logic: its answers against the pools'
actual hits (several pools, page sizes 1 and 16, salts, both hash forms),
stale batches of a restarted publisher, and prompts the pools would refuse."""

import numpy as np
import pytest

import kvpool

pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
from kvpool.events import LocalEventPublisher  # noqa: E402
from kvpool.router import Router  # noqa: E402

SEED = 21


def admit(a, tokens, salt=0):
    tokens = np.asarray(tokens, dtype=np.int64)
    h, c = a.open_with_prefix(tokens, [len(tokens)], salt)
    try:
        a.extend(h, len(tokens) - int(c[0]))
    finally:
        a.close(h, cache=True)


def hit(a, prompt, page_size, salt=0):
    """What ``a.open_with_prefix`` would return, without opening anything."""
    hashes = kvpool._core.page_hashes(prompt, page_size, SEED, salt)
    n = min(len(hashes) // 2, (len(prompt) - 1) // page_size)
    return page_size * a.match_chain_hashes(hashes[: 2 * n], prompt[: n * page_size], salt)


@pytest.mark.parametrize("page_size", [1, 16])
def test_match_is_every_pools_hit_after_every_step(page_size):
    """Three pools (two 16-byte, one int form) of different sizes and contents,
    salted prompts, evictions, clears and requests left open; every batch is
    delivered before the next look-up, so the router must be exact."""
    rng = np.random.default_rng(page_size)
    pools = [kvpool.SlotAllocator(n * (16 // page_size), page_size, 8, 1024, hash_seed=SEED) for n in (9, 14, 20)]
    pubs = [LocalEventPublisher(p, int_block_hashes=i == 1) for i, p in enumerate(pools)]
    r = Router(3, page_size=page_size, hash_seed=SEED)
    stems = [rng.integers(0, 50, size=int(rng.integers(1, 5 * page_size))) for _ in range(6)]
    held = [[] for _ in pools]
    for i in range(250):
        salt = int(rng.choice([0, 0, 7, -3, 2**63 - 1]))
        tail = rng.integers(0, 50, size=int(rng.integers(1, 2 * page_size + 2)))
        prompt = np.concatenate([stems[int(rng.integers(0, 6))], tail]).astype(np.int64)
        assert r.match(prompt, salt) == [hit(a, prompt, page_size, salt) for a in pools], i
        k = int(rng.integers(0, 3))
        a, op = pools[k], rng.random()
        try:
            if op < 0.04:
                a.clear_cache()
            elif op < 0.12:
                a.evict(int(rng.integers(1, 4)))
            elif op < 0.2 and held[k]:
                a.close(held[k].pop(), cache=bool(rng.random() < 0.5))
            elif op < 0.3 and len(held[k]) < 3:
                h, c = a.open_with_prefix(prompt, [len(prompt)], salt)
                held[k].append(h)
                a.extend(h, len(prompt) - int(c[0]))
                a.cache(h)
            else:
                admit(a, prompt, salt)
        except kvpool.PoolExhaustedError:  # a pool full of held pages
            pass
        for j, pub in enumerate(pubs):
            pub.publish()
            r.feed_many(j, pub.drain())


def step(pub, tokens):
    admit(pub.pool, tokens)
    pub.publish()
    return pub.drain()


def publisher():
    return LocalEventPublisher(kvpool.SlotAllocator(64, 4, 8, 512, hash_seed=SEED))


def _restarted(old_batches: int, fed: int, new_batches: int):
    """A router fed the first ``fed`` of an old publisher's ``old_batches`` batches, then
    ``new_batches`` of a new publisher's (a restart): (router, old batches, new publisher)."""
    r, old = Router(1, page_size=4, hash_seed=SEED), publisher()
    old_msgs = [step(old, np.arange(100 * i, 100 * i + 9))[0] for i in range(1, old_batches + 1)]
    for m in old_msgs[:fed]:
        r.feed(0, *m)
    new = publisher()
    for i in range(new_batches):
        r.feed_many(0, step(new, np.arange(5000 + 100 * i, 5009 + 100 * i)))
    return r, old_msgs, new


def test_a_late_batch_of_the_publisher_before_its_restart_is_not_applied():
    """The engine restarted and the router took its new stream; a batch the old
    engine sent before the restart arrives late (a reordered delivery, a queue
    drained behind the new connection), under a number the new stream has not
    reached. It is older than every batch applied (its ts), so it cannot be the
    new stream's: applying it would believe in pages the restarted pool lost."""
    r, old_msgs, new = _restarted(old_batches=7, fed=3, new_batches=5)
    assert r.streams[0].restarts == 1 and r.streams[0].next_seq == 5
    assert r.feed(0, *old_msgs[5]) == 0, "old seq 5: older than the batches applied"
    assert r.feed(0, *old_msgs[6]) == 0 and not r.streams[0].pending, "nor kept to apply later"
    assert r.match(np.arange(600, 609)) == [0] and r.match(np.arange(700, 709)) == [0]
    assert r.feed_many(0, step(new, np.arange(9000, 9009))) == 1, "the new stream goes on"
    assert r.match(np.arange(9000, 9009)) == [8]


def test_a_late_batch_under_a_number_the_new_stream_applied_is_not_a_restart():
    """The same late batch, under a number the new stream has already applied:
    it differs from the applied one, but it is the older of the two (its ts),
    so it is a stale copy, not a second restart to take as the stream's start
    (the pool is forgotten: fewer predicted hits, none wrongly believed)."""
    r, old_msgs, new = _restarted(old_batches=4, fed=2, new_batches=3)
    assert r.streams[0].restarts == 1 and r.streams[0].next_seq == 3
    assert r.feed(0, *old_msgs[2]) == 0 and r.streams[0].restarts == 1
    assert r.match(np.arange(300, 309)) == [0], "the restarted pool never held it"
    assert r.feed_many(0, step(new, np.arange(9000, 9009))) == 1, "the new stream goes on"
    assert r.match(np.arange(9000, 9009)) == [8]


def test_of_two_batches_under_one_waiting_number_the_older_is_the_stale_one():
    """A new stream's batch waits behind a gap; the old publisher's batch under
    the same number comes late. The older one must not restart the stream over
    the newer one."""
    r, old = Router(1, page_size=4, hash_seed=SEED), publisher()
    old_msgs = [step(old, np.arange(100 * i, 100 * i + 9))[0] for i in range(1, 5)]
    r.feed(0, *old_msgs[0])
    new = publisher()
    new_msgs = [step(new, np.arange(5000 + 100 * i, 5009 + 100 * i))[0] for i in range(3)]
    assert r.feed(0, *new_msgs[2]) == 0 and r.needs_replay(0) == 1
    assert r.feed(0, *old_msgs[2]) == 0 and r.streams[0].restarts == 0
    assert r.match(np.arange(300, 309)) == [0]


@pytest.mark.parametrize("tokens, salt", [
    ([1, 2, -1], 0), ([5], 2**64), ([], "x"), (list(range(8)) + [-1], 0), (list(range(8)) + [2**31], 0),
    ([1, 2], 1.5), ([1, 2], True),
], ids=["short-neg-token", "short-salt-range", "empty-salt-str", "tail-neg-token", "tail-big-token",
        "short-salt-float", "short-salt-bool"])
def test_a_prompt_the_pools_refuse_is_refused_at_every_length(tokens, salt):
    """match/route check the whole prompt and the salt as open_with_prefix does, not
    only the whole pages they hash: otherwise route() counts a request no pool takes."""
    a = kvpool.SlotAllocator(64, 4, 8, 512, hash_seed=SEED)
    with pytest.raises(kvpool.InvalidArgumentError):
        a.open_with_prefix(np.asarray(tokens, dtype=np.int64), [len(tokens)], salt)
    r = Router(2, page_size=4, hash_seed=SEED)
    with pytest.raises(kvpool.InvalidArgumentError):
        r.match(np.asarray(tokens, dtype=np.int64), salt)
    with pytest.raises(kvpool.InvalidArgumentError):
        r.route(np.asarray(tokens, dtype=np.int64), salt)
    assert r.load == [0, 0]


def test_a_batch_with_an_infinite_ts_is_refused():
    """Every later batch would be older than it, and ignored."""
    import msgspec

    r, pub = Router(1, page_size=4, hash_seed=SEED), publisher()
    (topic, seq, payload), = step(pub, np.arange(9))
    body = msgspec.msgpack.decode(payload)
    for ts in (float("inf"), float("nan")):
        with pytest.raises(kvpool.InvalidArgumentError, match="ts"):
            r.feed(0, topic, seq, msgspec.msgpack.encode([ts, *body[1:]]))
        assert r.streams[0].next_seq is None
    assert r.feed(0, topic, seq, payload) == 1 and r.match(np.arange(9)) == [8]


def test_a_clock_gone_back_never_leaves_a_removed_page_believed():
    """The same rule from the other side: one publisher whose ts went back. Its
    batches are ignored, and the pool forgotten, so the page they removed is
    not believed; once its ts passes the last applied one, it is learned again."""
    import msgspec

    r, pub = Router(1, page_size=4, hash_seed=SEED), publisher()
    r.feed_many(0, step(pub, np.arange(9)))
    pub.pool.evict(2)
    pub.publish()
    (topic, seq, payload), = pub.drain()
    body = msgspec.msgpack.decode(payload)
    back = msgspec.msgpack.encode([body[0] - 3600.0, *body[1:]])
    assert r.feed(0, topic, seq, back) == 0
    assert r.match(np.arange(9)) == [0], "evicted by the ignored batch"
    assert r.feed_many(0, step(pub, np.arange(20, 29))) == 0, "waits behind the ignored one"
    r.give_up_gap(0)
    assert r.match(np.arange(20, 29)) == [8] and r.match(np.arange(9)) == [0]


def test_after_resync_a_late_batch_is_not_taken_as_the_new_start():
    """resync() (a publisher that went away, its history unchecked) takes the next
    batch as the stream's start, but not one older than those the router took: a
    batch queued before the restart would be believed until the new engine speaks."""
    r, old = Router(1, page_size=4, hash_seed=SEED), publisher()
    old_msgs = [step(old, np.arange(100 * i, 100 * i + 9))[0] for i in range(1, 4)]
    r.feed(0, *old_msgs[0])
    r.feed(0, *old_msgs[1])
    r.resync(0)  # the old engine went away
    assert r.feed(0, *old_msgs[0]) == 0 and r.match(np.arange(100, 109)) == [0]
    assert r.streams[0].next_seq is None, "still waiting for the new stream's start"
    new = publisher()
    assert r.feed_many(0, step(new, np.arange(5000, 5009))) == 1 and r.match(np.arange(5000, 5009)) == [8]


def snapshot(r):
    st = r.streams[0]
    return (st.next_seq, dict(st.pending), st.batches, st.duplicates, st.resets, st.restarts, st.cleared,
            st.checked_seed, list(st.applied.items()), st.last_ts, dict(r.index.where), set(r.index.held[0]))


def test_lost_duplicated_reordered_and_restarted_streams_never_overstate_a_pool():
    """One pool's stream through restarts (publishers numbering from 0 again),
    delivered with losses, duplicates, reorders and late batches of earlier
    publishers, gaps given up and resyncs. After every step, the pages the router
    believes are a subset of what the pool held when it sent the last batch
    applied, except in the documented blind spot (a restarted publisher's batch
    under exactly the number the router expects next, until the pool is next
    forgotten). A feed_many refused at its last message (a pool with another
    seed, restarting the stream; garbage) changes nothing."""
    from kvpool.events.schema import decoder

    decode, rng = decoder().decode, np.random.default_rng(7)
    for trial in range(40):
        r = Router(1, page_size=4, hash_seed=SEED, max_pending=int(rng.integers(0, 6)))
        incs, blind = [], None  # per publisher: (publisher, messages, held after each), the blind spot's mark
        for i in range(150):
            op = rng.random()
            if op < 0.03 or not incs:
                incs.append((LocalEventPublisher(kvpool.SlotAllocator(int(rng.integers(6, 20)), 4, 8, 512,
                                                                      hash_seed=SEED)), [], []))
            pub, msgs, held = incs[-1]
            if op < 0.5:
                try:
                    admit(pub.pool, rng.integers(0, 8, size=int(rng.integers(2, 14))))
                except kvpool.PoolExhaustedError:
                    pass
                if rng.random() < 0.1:
                    pub.pool.evict(int(rng.integers(1, 4)))
                if rng.random() < 0.03:
                    pub.pool.clear_cache()
                if pub.publish():
                    msgs += pub.drain()
                    now = set(held[-1]) if held else set()
                    for ev in decode(msgs[-1][2]).events:
                        kind = type(ev).__name__
                        if kind == "AllBlocksCleared":
                            now.clear()
                        elif kind == "BlockStored":
                            now.update(ev.block_hashes)
                        else:
                            now.difference_update(ev.block_hashes)
                    held.append(now)
            elif op < 0.95:
                k = len(incs) - 1 if rng.random() < 0.85 else int(rng.integers(0, len(incs)))
                ms, st = incs[k][1], r.streams[0]
                if not ms:
                    continue
                j = int(rng.integers(0, len(ms)))
                if k == len(incs) - 1 and st.next_seq is not None and rng.random() < 0.7:
                    j = min(len(ms) - 1, max(st.next_seq, 0) + int(rng.integers(0, 3)))
                if st.next_seq is not None and j == st.next_seq and j - 1 in st.applied \
                        and (j == 0 or hash(ms[j - 1][2]) != st.applied[j - 1]):
                    blind = (st.restarts, st.resets, st.cleared)
                if rng.random() < 0.1:  # refused after ms[j] applied: its seed check, or garbage
                    other = LocalEventPublisher(kvpool.SlotAllocator(16, 4, 8, 512, hash_seed=SEED + 1))
                    bad = step(other, np.arange(9)) if rng.random() < 0.5 else [(b"", ms[j][1], b"\x93garbage")]
                    before = snapshot(r)
                    with pytest.raises(kvpool.InvalidArgumentError):
                        r.feed_many(0, [ms[j], *bad])
                    assert snapshot(r) == before, (trial, i)
                r.feed(0, *ms[j])
            elif op < 0.98:
                if r.needs_replay(0) is not None:
                    r.give_up_gap(0)
            else:
                r.resync(0)
            st = r.streams[0]
            if blind is not None and blind != (st.restarts, st.resets, st.cleared):
                blind = None
            if blind is not None or st.next_seq is None or st.next_seq - 1 not in st.applied:
                continue
            last = st.applied[st.next_seq - 1]
            source = [h[st.next_seq - 1] for _, ms, h in incs
                      if len(ms) >= st.next_seq and hash(ms[st.next_seq - 1][2]) == last]
            assert source and r.index.held[0] <= source[0], (trial, i)


@pytest.mark.parametrize("num_pools", [4, 100])
def test_a_numpy_pool_index_is_a_pool_index(num_pools):
    """feed takes a numpy int as the pool (is_int), and the index used it as is in
    its bit masks: np.int64 masks broke every later match (OverflowError past 63
    pools, AttributeError on bit_length below), for all pools."""
    r, pub = Router(num_pools, page_size=4, hash_seed=SEED), publisher()
    r.feed_many(np.int64(num_pools - 2), step(pub, np.arange(9)))
    r.feed_many(0, [])
    assert r.match(np.arange(9)) == [0] * (num_pools - 2) + [8, 0]
    r.forget(np.int32(num_pools - 2))
    assert r.match(np.arange(9)) == [0] * num_pools and len(r.index) == 0


def test_for_a_pool_with_a_host_tier_the_prediction_is_a_lower_bound():
    """open_with_prefix counts host hits too, and the router counts GPU pages only
    (its medium): a page evicted to the host is a Removed for the GPU, yet a hit.
    The docs said the prediction differs only while events are in flight."""
    a = kvpool.SlotAllocator(6, 4, 4, 64, hash_seed=SEED, host_pages=32, host_policy="write_back")
    pub, r = LocalEventPublisher(a), Router(1, page_size=4, hash_seed=SEED)
    rng, under = np.random.default_rng(1), 0
    stems = [rng.integers(0, 50, size=8) for _ in range(5)]
    for i in range(60):
        prompt = np.concatenate([stems[i % 5], rng.integers(0, 50, size=2)]).astype(np.int64)
        predicted = r.match(prompt)[0]
        h, c = a.open_with_prefix(prompt, [len(prompt)])
        a.extend(h, len(prompt) - int(c[0]))
        a.close(h, cache=True)
        a.take_offloads(), a.take_loads()
        assert predicted <= int(c[0]), i
        under += predicted < int(c[0])
        pub.publish()
        r.feed_many(0, pub.drain())
    assert under > 0, "hits served from the host that the router does not count"
