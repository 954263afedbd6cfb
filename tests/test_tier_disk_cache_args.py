"""DiskCache.store_new's arguments: ``events`` that are not what ``take_events()``
returns, and a ``max_pages`` that is not a count, are typed errors that say what is
expected and leave the cache and the pool as they were; numpy integers are counts.
``prefetch``'s salt is checked at every prompt length."""

from __future__ import annotations

import numpy as np
import pytest
from test_tier_disk_cache import TOKENS, make_pool, prefill

import kvpool
from kvpool.tiers import DiskCache, FileTier


@pytest.fixture
def pending(tmp_path):
    """A pool with a 4-page prefix registered and its events drained, not yet stored."""
    pool = make_pool(hash_seed=11)
    prefill(pool, TOKENS, seed=1)
    dc = DiskCache(pool, FileTier(tmp_path, 1 << 20), model="m")
    return pool, dc, pool.take_events()


def _without(ev, key):
    return {k: v for k, v in ev.items() if k != key}


BAD_EVENTS = [
    ("a str", lambda ev: "events"),
    ("a list", lambda ev: [ev]),
    ("an empty dict", lambda ev: {}),
    ("no hash_lo", lambda ev: _without(ev, "hash_lo")),
    ("no token_ids", lambda ev: _without(ev, "token_ids")),
    ("a short parent_hi", lambda ev: {**ev, "parent_hi": ev["parent_hi"][:-1]}),
    ("too few token_ids", lambda ev: {**ev, "token_ids": ev["token_ids"][:-1]}),
    ("float kinds", lambda ev: {**ev, "kind": ev["kind"].astype(np.float64)}),
    ("a 2-D hash_hi", lambda ev: {**ev, "hash_hi": ev["hash_hi"].reshape(1, -1)}),
    ("an unknown kind", lambda ev: {**ev, "kind": ev["kind"] + 7}),
    ("negative num_tokens", lambda ev: {**ev, "num_tokens": -ev["num_tokens"]}),
]


@pytest.mark.parametrize("name,damage", BAD_EVENTS, ids=[b[0] for b in BAD_EVENTS])
def test_events_that_are_not_take_events_output_are_typed_and_change_nothing(pending, name, damage):
    pool, dc, ev = pending
    with pytest.raises(kvpool.InvalidArgumentError, match="events"):
        dc.store_new(events=damage(ev))
    assert (dc._entries, dc._pending, dc.stats.pages_stored) == ({}, {}, 0)
    assert pool.open_requests == 0
    pool.check()
    assert dc.store_new(events=ev) == 4, "the real events still store every page"


def test_max_pages_takes_numpy_ints_and_refuses_what_is_not_a_count(pending):
    pool, dc, ev = pending
    for bad in (-1, True, 1.0, "2", np.float64(2)):
        with pytest.raises(kvpool.InvalidArgumentError, match="max_pages"):
            dc.store_new(events=ev, max_pages=bad)
    assert dc.store_new(events=ev, max_pages=np.int64(3)) == 3
    assert dc.store_new(max_pages=np.uint8(5)) == 1


@pytest.mark.parametrize("length", [0, 3, 18])
@pytest.mark.parametrize("salt", ["s", 1.5, True, 2**64, [7]])
def test_prefetch_refuses_a_salt_that_is_not_one_int_at_any_prompt_length(tmp_path, length, salt):
    """A prompt too short to hold a full page hashes nothing; its bad salt was let through
    (prefetch returned 0) where ``open_with_prefix`` of the same prompt refuses it."""
    pool = make_pool(hash_seed=11)
    prefill(pool, TOKENS, seed=1)
    dc = DiskCache(pool, FileTier(tmp_path, 1 << 20), model="m")
    assert dc.store_new() == 4
    pool.clear_cache()
    pool.take_events()
    before = repr((pool.stats(), dc.stats))
    with pytest.raises(kvpool.InvalidArgumentError, match="salt"):
        dc.prefetch(TOKENS[:length], salt=salt)
    assert repr((pool.stats(), dc.stats)) == before
    assert len(pool.take_events()["kind"]) == 0
    pool.check()
    assert dc.prefetch(TOKENS, salt=None) == 4, "a good call still loads"
