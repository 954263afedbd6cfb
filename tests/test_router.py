"""kvpool.router fed in-process: longest cached prefix with a load tie-break,
agreement with the pools' own cached_lens, Cleared, gaps, duplicates and
out-of-order batches, and a pool hashing with another seed."""

import numpy as np
import pytest

import kvpool

pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
from kvpool.events import LocalEventPublisher  # noqa: E402
from kvpool.router import Router  # noqa: E402

P, SEED = 4, 21


def fleet(n=3, pages=64):
    pools = [kvpool.SlotAllocator(pages, P, 8, 512, hash_seed=SEED) for _ in range(n)]
    return pools, [LocalEventPublisher(p) for p in pools], Router(n, page_size=P, hash_seed=SEED)


def admit(a, tokens, close=True):
    tokens = np.asarray(tokens, dtype=np.int64)
    h, c = a.open_with_prefix(tokens, [len(tokens)])
    a.extend(h, len(tokens) - int(c[0]))
    a.cache(h)
    if close:
        a.close(h)
    return int(c[0])


def deliver(pubs, router):
    for i, pub in enumerate(pubs):
        pub.publish()
        router.feed_many(i, pub.drain())


def test_routes_to_the_longest_cached_prefix_then_the_least_loaded():
    pools, pubs, r = fleet()
    base = np.arange(1000, 1013)
    admit(pools[0], base[:5])  # 1 page
    admit(pools[1], base)  # 3 pages
    deliver(pubs, r)
    assert r.match(base) == [4, 12, 0]
    assert r.match(base[:12]) == [4, 8, 0], "at least one token is left to compute"
    assert r.route(base) == type(r.route(base))(1, 12)
    assert r.load == [0, 2, 0]
    # No pool caches it: the least loaded wins, then the lowest index.
    other = np.arange(5000, 5010)
    assert r.route(other).pool == 0
    assert r.route(other).pool == 2
    assert r.route(other, loads=[5, 1, 3]).pool == 1
    # Loads are any real numbers (relative ones may be negative); inf: only on a longer prefix.
    assert r.route(other, loads=[-2.5, 1, 3]).pool == 0
    assert r.route(other, loads=[float("inf"), 7, float("inf")]).pool == 1
    assert r.route(base, loads=[0, float("inf"), 0]).pool == 1, "the longest prefix still wins"
    for pool in (0, 1, 1):  # (the three routes above, finished)
        r.finished(pool)
    assert r.route(base, eligible=[True, False, True]).pool == 0, "only pools with room"
    r.finished(1)
    assert r.load == [2, 2, 1]
    with pytest.raises(kvpool.InvalidArgumentError, match="eligible"):
        r.route(base, eligible=[False, False, False])
    assert r.route(base, salt=3).cached_tokens == 0, "another salt shares nothing"


def test_predictions_agree_with_the_pools_cached_lens_under_eviction():
    """Random shared prefixes over small pools (eviction every few requests):
    with every batch delivered before the next request, the router's
    prediction is exactly what open_with_prefix returns."""
    pools, pubs, r = fleet(n=3, pages=24)
    rng = np.random.default_rng(3)
    stems = [rng.integers(0, 50, size=int(rng.integers(4, 40))) for _ in range(6)]
    removed = 0
    for i in range(300):
        prompt = np.concatenate([stems[int(rng.integers(0, 6))], rng.integers(0, 50, size=int(rng.integers(1, 9)))])
        hashes = kvpool._core.page_hashes(prompt, P, SEED)
        n = min(len(hashes) // 2, (len(prompt) - 1) // P)
        truth = [P * a.match_chain_hashes(hashes[: 2 * n], prompt[: n * P]) for a in pools]
        assert r.match(prompt) == truth, i  # every pool, not just the chosen one
        route = r.route(prompt)
        got = admit(pools[route.pool], prompt)
        assert got == route.cached_tokens, (i, route, got)
        deliver(pubs, r)
        r.finished(route.pool)
        removed = sum(pub.removed_pages for pub in pubs)
    assert removed > 100, "the pools evicted all along"
    assert max(r.load) == 0


def test_all_blocks_cleared_forgets_the_pool():
    pools, pubs, r = fleet()
    prompt = np.arange(9)
    for p in pools[:2]:
        admit(p, prompt)
    deliver(pubs, r)
    assert r.match(prompt) == [8, 8, 0]
    pools[0].clear_cache()
    deliver(pubs, r)
    assert r.match(prompt) == [0, 8, 0] and r.streams[0].cleared == 1 and r.pages(0) == 0


def test_out_of_order_duplicate_and_lost_batches():
    pools, pubs, r = fleet(n=1)
    a, pub = pools[0], pubs[0]
    prompts = [np.arange(100 * i, 100 * i + 9) for i in range(1, 5)]
    msgs = []
    for pr in prompts:
        admit(a, pr)
        pub.publish()
        msgs += pub.drain()
    # Out of order: a later batch waits for the one before it.
    assert r.feed(0, *msgs[0]) == 1
    assert r.feed(0, *msgs[2]) == 0 and r.needs_replay(0) == 1
    assert r.match(prompts[2])[0] == 0, "not applied while a batch before it is missing"
    assert r.feed(0, *msgs[1]) == 2 and r.needs_replay(0) is None
    assert r.match(prompts[2])[0] == 8
    # Replayed duplicates are ignored.
    assert r.feed(0, *msgs[1]) == 0 and r.streams[0].duplicates == 1
    # A batch that never comes: give up, forget the pool, go on after the gap.
    a.evict(2)  # msgs[4]: prompts[3]'s tail ... lost
    pub.publish()
    lost = pub.drain()
    admit(a, np.arange(900, 909))
    pub.publish()
    after = pub.drain()
    assert r.feed(0, *after[0]) == 0
    r.give_up_gap(0)
    assert r.streams[0].resets == 1
    assert r.match(prompts[0])[0] == 0, "everything before the gap is forgotten"
    assert r.match(np.arange(900, 909))[0] == 8
    assert len(lost) == 1


def test_too_many_waiting_batches_give_up_the_gap():
    pools, pubs, r = fleet(n=1)
    r.max_pending = 2
    msgs = []
    for i in range(5):
        admit(pools[0], np.arange(10 * i, 10 * i + 5))
        pubs[0].publish()
        msgs += pubs[0].drain()
    r.feed(0, *msgs[0])
    for m in msgs[2:4]:
        assert r.feed(0, *m) == 0
    assert r.feed(0, *msgs[4]) == 3 and r.streams[0].resets == 1
    assert r.match(np.arange(0, 5))[0] == 0 and r.match(np.arange(40, 45))[0] == 4


def test_a_pool_with_another_seed_or_page_size_is_refused():
    a = kvpool.SlotAllocator(64, P, 8, 512, hash_seed=SEED + 1)
    pub = LocalEventPublisher(a)
    admit(a, np.arange(9))
    pub.publish()
    with pytest.raises(kvpool.InvalidArgumentError, match="hash_seed"):
        Router(1, page_size=P, hash_seed=SEED).feed_many(0, pub.drain())
    b = kvpool.SlotAllocator(64, 2 * P, 8, 512, hash_seed=SEED)
    pub = LocalEventPublisher(b)
    admit(b, np.arange(9))
    pub.publish()
    with pytest.raises(kvpool.InvalidArgumentError, match="page_size"):
        Router(1, page_size=P, hash_seed=SEED).feed_many(0, pub.drain())


@pytest.mark.parametrize("layer_types", [None, ["full_attention", "sliding_attention"]])
def test_a_router_built_from_a_pools_own_hash_seed_accepts_its_events(layer_types):
    """The refusal above tells the caller to pass ``pool.hash_seed``: a ``KVPool``
    (plain or hybrid) built with a random seed must say what it is."""
    hybrid = {} if layer_types is None else {"layer_types": layer_types, "sliding_window": 8}
    pool = kvpool.KVPool(2, 1, 8, page_size=P, num_pages=64, max_requests=8, max_context_len=512, **hybrid)
    assert pool.hash_seed == pool.allocator.hash_seed
    pub = LocalEventPublisher(pool)
    admit(pool, np.arange(13))
    pub.publish()
    r = Router(1, page_size=P, hash_seed=pool.hash_seed)
    r.feed_many(0, pub.drain())
    assert r.route(np.arange(13)).cached_tokens == 12


def test_a_malformed_message_is_typed_and_leaves_the_stream_as_it_was():
    """A frame that is not a KV event batch (or a seq frame that is not 8 bytes or not in
    [0, 2**63), or a pool that is not an index) is refused before the stream moves: the next
    good message still applies in order."""
    import dataclasses

    pools, pubs, r = fleet(n=1)
    admit(pools[0], np.arange(9))
    pubs[0].publish()
    (topic, seq, payload), = pubs[0].drain()
    bad = [(0, topic, seq, b"\x93not msgpack"), (0, topic, seq, b"\x92\x01\x02"), (0, topic, seq[:4], payload),
           (0, topic, "x" * 8, payload), ("0", topic, seq, payload), (True, topic, seq, payload),
           (1.0, topic, seq, payload),
           # Past int64 (read as negative): a gap up to it asked for a replay no int64 names,
           # and ZmqFeed.poll raised OverflowError on every later call.
           (0, topic, (2**64 - 3).to_bytes(8, "big"), payload), (0, topic, (2**63).to_bytes(8, "big"), payload)]
    for args in bad:
        before = dataclasses.replace(r.streams[0], pending=dict(r.streams[0].pending))
        with pytest.raises(kvpool.InvalidArgumentError):
            r.feed(*args)
        assert r.streams[0] == before and r.pages(0) == 0
    assert r.feed(0, topic, seq, payload) == 1 and r.match(np.arange(9)) == [8]


@pytest.mark.parametrize("call", [
    lambda: Router("2", page_size=P, hash_seed=SEED), lambda: Router(2, page_size=4.0, hash_seed=SEED),
    lambda: Router(2, page_size=P, hash_seed="x"), lambda: Router(2, page_size=P, hash_seed=-1),
    lambda: Router(2, page_size=P, hash_seed=SEED, max_pending=True), lambda: Router(0, page_size=P, hash_seed=SEED),
    lambda: Router(2, page_size=P, hash_seed=SEED, medium="gpu"), lambda: Router(2, page_size=P, hash_seed=SEED, medium=0),
], ids=["num_pools-str", "page_size-float", "seed-str", "seed-negative", "max_pending-bool", "no-pools",
        "medium-lowercase", "medium-int"])
def test_router_arguments_are_checked_at_construction(call):
    with pytest.raises(kvpool.InvalidArgumentError):
        call()


def test_route_takes_one_prompt_and_an_int_pool():
    _, _, r = fleet(n=2)
    for bad in ("abc", [[1, 2, 3], [4, 5, 6]]):
        with pytest.raises(kvpool.InvalidArgumentError, match="1-D"):
            r.route(bad)
    assert r.load == [0, 0]
    for pool in ("0", 1.0, True, 2):
        with pytest.raises(kvpool.InvalidArgumentError, match=r"pool must be an int in \[0, 2\)"):
            r.finished(pool)


def test_for_a_grouped_pool_the_prediction_is_an_upper_bound():
    """A GroupedAllocator publishes its anchor chain only, so the router knows
    which full-attention prefixes it holds, not whether a sliding group still
    holds the window before them: its prediction never falls below the hit the
    pool serves, and exceeds it once the sliding group has evicted."""
    g = kvpool.GroupedAllocator([{"kind": "full", "num_pages": 200, "page_size": P},
                                 {"kind": "sliding", "num_pages": 30, "page_size": P, "window": 2 * P}],
                                16, 256, hash_seed=SEED)
    pub, r = LocalEventPublisher(g), Router(1, page_size=g.anchor_page_size, hash_seed=SEED)
    rng = np.random.default_rng(0)
    stems = [rng.integers(0, 50, size=10 * P) for _ in range(4)]
    over = 0
    for i in range(60):
        prompt = np.concatenate([stems[i % 4], rng.integers(0, 50, size=5)])
        predicted = r.match(prompt)[0]
        h, c = g.open_with_prefix(prompt, [len(prompt)])
        assert predicted >= int(c[0]), i
        over += predicted > int(c[0])
        g.extend(h, len(prompt) - int(c[0]))
        g.close(h, cache=True)
        pub.publish()
        r.feed_many(0, pub.drain())
    assert over > 0, "the sliding group evicted windows the anchor chain still names"


def test_a_second_full_group_that_evicted_a_prefix_lowers_the_hit_below_the_prediction():
    """Not only sliding and state groups: a second full group of the anchor's page size
    evicts from its own LRU, and its evictions send no event (docs/events-and-metrics.md
    named only the sliding and state causes, so an all-full pool read as exact)."""
    g = kvpool.GroupedAllocator([{"kind": "full", "num_pages": 12, "page_size": 2},
                                 {"kind": "full", "num_pages": 4, "page_size": 2}], 4, 32, hash_seed=SEED)
    pub, r = LocalEventPublisher(g), Router(1, page_size=2, hash_seed=SEED)
    for t in ([1, 2, 3, 4], [5, 6, 7, 8, 9, 10]):  # the second takes the small group's every page
        h, c = g.open_with_prefix(np.array(t), [len(t)])
        g.extend(h, len(t) - int(c[0]), tokens=t[int(c[0]):])
        g.close(h, cache=True)
    pub.publish()
    r.feed_many(0, pub.drain())
    prompt = np.array([1, 2, 3, 4, 9])
    assert r.match(prompt)[0] == 4, "the anchor group still holds [1, 2, 3, 4]: no Removed event"
    assert [x["cached_pages"] for x in g.stats()["groups"]] == [5, 3], "the small group evicted a page of it"
    h, c = g.open_with_prefix(prompt, [len(prompt)])
    assert int(c[0]) == 0


def test_a_router_copies_and_pickles_as_a_whole_independent_router():
    # pickle failed with "cannot pickle 'msgspec.msgpack.Decoder'
    # object", naming neither the router nor a fix, and copy.copy shared the index, the
    # streams and the loads: feeding the copy changed what the original routed.
    import copy
    import pickle

    pools, pubs, r = fleet()
    base = np.arange(1000, 1013)
    admit(pools[1], base)
    deliver(pubs, r)
    want = r.route(base)
    assert want.pool == 1 and want.cached_tokens == 12
    for clone in (copy.copy(r), copy.deepcopy(r), pickle.loads(pickle.dumps(r))):
        assert clone.load == r.load == [0, 1, 0]
        assert clone.route(base) == want
        assert clone.load == [0, 2, 0] and r.load == [0, 1, 0]  # (route counts in its own router)
    shallow = copy.copy(r)
    pools[1].clear_cache()
    pubs[1].publish()
    shallow.feed_many(1, pubs[1].drain())
    assert shallow.route(base).cached_tokens == 0
    assert r.route(base) == want  # the original still holds pool 1's pages
    assert r.load == [0, 2, 0] and shallow.load[1] == 1  # (each counts its own routes)
