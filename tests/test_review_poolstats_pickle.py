"""A PoolStats pickled by an earlier kvpool still unpickles (a rolling upgrade: old
workers send stats() snapshots to a new collector): the fields it lacks take their
documented defaults. Today's pickle is by field name; a newer kvpool's extra fields
are ignored."""

import pickle

import numpy as np
import pytest

import kvpool
from kvpool._core import PoolStats, _pool_stats

# pickle.dumps(alloc.stats(), protocol=4) as kvpool b2d1510 ("PoolStats: compare by
# value and pickle") up to 0ac4d13 wrote it: __reduce__ was
# (kvpool._core._pool_stats, ([17 counters in declaration order],)); here the counters
# are 11..27 so that a misplaced one shows.
OLD_17 = (
    b"\x80\x04\x95J\x00\x00\x00\x00\x00\x00\x00\x8c\x0ckvpool._core\x94\x8c\x0b_pool_stats"
    b"\x94\x93\x94]\x94(K\x0bK\x0cK\rK\x0eK\x0fK\x10K\x11K\x12K\x13K\x14K\x15K\x16K\x17K\x18"
    b"K\x19K\x1aK\x1be\x85\x94R\x94."
)
OLD_NAMES = [
    "free_pages", "used_pages", "free_slots", "used_slots", "open_requests", "admissible_tokens",
    "metadata_bytes", "cached_pages", "evictable_pages", "hit_tokens", "miss_tokens", "pinned_pages",
    "host_free_pages", "host_cached_pages", "host_hit_tokens", "offloaded_pages", "loaded_pages",
]


class _Reduces:
    """Pickles as the given __reduce__ output: how another kvpool's PoolStats pickled."""

    def __init__(self, state):
        self.state = state

    def __reduce__(self):
        return (_pool_stats, (self.state,))


def busy_stats():
    alloc = kvpool.SlotAllocator(12, 4, 4, 64, hash_seed=1, manual_clock=True)
    for i, prio in enumerate([10, None, 90]):
        h, _ = alloc.open_with_prefix(np.arange(100 * i, 100 * i + 9), [9])
        alloc.extend(h, 9)
        alloc.close(h, cache=True, priority=prio)
    h, _ = alloc.open_with_prefix(np.arange(500, 505), [5])
    alloc.extend(h, 5)
    return alloc.stats()


def test_a_pickle_of_the_17_counter_layout_loads_with_defaults_for_the_new_fields():
    s = pickle.loads(OLD_17)
    assert isinstance(s, PoolStats)
    assert [getattr(s, n) for n in OLD_NAMES] == list(range(11, 28))
    assert s.dropped_events == 0
    assert s.evictable_pages_by_priority == []
    # It pickles again (today's form) and comes back equal.
    assert pickle.loads(pickle.dumps(s)) == s
    # The fixture is what that __reduce__ wrote.
    assert pickle.dumps(_Reduces(list(range(11, 28))), protocol=4) == OLD_17


def test_a_pickle_of_the_119_int_layout_loads():
    """0ac4d13 pickled 18 counters then the 101 priority counts, flat."""
    s = busy_stats()
    flat = [getattr(s, n) for n in OLD_NAMES] + [s.dropped_events] + s.evictable_pages_by_priority
    assert len(flat) == 119
    back = pickle.loads(pickle.dumps(_Reduces(flat)))
    assert back == s and sum(back.evictable_pages_by_priority) == back.evictable_pages == 6


def test_the_current_snapshot_round_trips_by_field_name():
    s = busy_stats()
    fn, (state,) = s.__reduce__()
    assert fn is _pool_stats and isinstance(state, dict)
    assert state["evictable_pages_by_priority"] == s.evictable_pages_by_priority
    assert state["used_pages"] == s.used_pages == 2
    for proto in range(2, pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(s, protocol=proto))
        assert back == s and repr(back) == repr(s)


def test_a_newer_kvpool_s_extra_fields_are_ignored():
    s = busy_stats()
    _, (state,) = s.__reduce__()
    newer = dict(state, spilled_pages=7, by_tenant={"a": 1})
    assert pickle.loads(pickle.dumps(_Reduces(newer))) == s


def test_a_dict_without_the_fields_added_since_takes_their_defaults():
    s = busy_stats()
    _, (state,) = s.__reduce__()
    del state["dropped_events"], state["evictable_pages_by_priority"]
    back = _pool_stats(state)
    assert back.dropped_events == 0 and back.evictable_pages_by_priority == []
    assert back.used_pages == s.used_pages


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda d: d.pop("free_pages"), "has no free_pages"),
        (lambda d: d.update(hit_tokens=-1), "hit_tokens must be an int"),
        (lambda d: d.update(used_pages="3"), "used_pages must be an int"),
        (lambda d: d.update(evictable_pages_by_priority=[0] * 100), "list of 101 ints"),
    ],
)
def test_a_state_that_no_kvpool_pickled_is_a_typed_error(change, match):
    _, (state,) = busy_stats().__reduce__()
    change(state)
    with pytest.raises(kvpool.InvalidArgumentError, match=match):
        _pool_stats(state)


@pytest.mark.parametrize("state", [[0] * 16, [0] * 18, [0] * 120, "free_pages", None, [-1] * 17])
def test_a_flat_list_of_another_length_or_type_is_a_typed_error(state):
    with pytest.raises(kvpool.InvalidArgumentError, match="flat list of 17 counters"):
        _pool_stats(state)
