"""Review leftovers: a pool says whether it records KV events (and DiskCache, which
learns what to store from them, refuses a pool that does not); a refused fork names
fork, not open; a state group's shortage speaks of state slots, not pages."""

from __future__ import annotations

import pytest
import torch
from test_tier_disk_cache import make_pool

import kvpool
from kvpool import GroupedAllocator, SlotAllocator
from kvpool.tiers import DiskCache, FileTier

GROUPS = [{"kind": "full", "num_pages": 16, "page_size": 4}, {"kind": "state", "num_slots": 3}]


# ----- kv_events, readable -----------------------------------------------------------------------

@pytest.mark.parametrize("flag", [True, False])
def test_allocators_and_pools_say_whether_they_record_kv_events(flag):
    assert SlotAllocator(8, kv_events=flag).kv_events is flag
    assert GroupedAllocator(GROUPS, 4, 32, kv_events=flag).kv_events is flag
    assert make_pool(kv_events=flag).kv_events is flag
    hybrid = kvpool.KVPool(2, 2, 8, layer_types=["full_attention", "linear_attention"], state_shapes={"conv": (6, 4)},
                           dtype=torch.float32, page_size=4, num_pages=16, max_requests=4, max_context_len=32,
                           kv_events=flag)
    assert hybrid.kv_events is flag


def test_kv_events_is_read_only():
    a = SlotAllocator(8)
    with pytest.raises(AttributeError):
        a.kv_events = False
    assert a.kv_events is True


def test_disk_cache_refuses_a_pool_without_kv_events(tmp_path):
    """It learns which pages to store from the pool's Stored events: without them it would
    silently store nothing, forever."""
    pool = make_pool(kv_events=False)
    with pytest.raises(kvpool.InvalidArgumentError, match=r"kv_events=True") as info:
        DiskCache(pool, FileTier(tmp_path, 1 << 20), model="m")
    assert "event" in str(info.value).split("kv_events=True", 1)[1], str(info.value)
    pool.check()
    DiskCache(make_pool(), FileTier(tmp_path, 1 << 20), model="m")  # the default pool is accepted


# ----- fork past max_requests --------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: SlotAllocator(16, 4, max_requests=3, max_context_len=32),
                                  lambda: GroupedAllocator(GROUPS[:1], 3, 32)], ids=["slot", "grouped"])
def test_a_refused_fork_names_fork_and_how_many_would_fit(make):
    a = make()
    h = a.open(2)
    with pytest.raises(kvpool.TooManyRequestsError) as info:
        a.fork(h[0], 2)
    msg = str(info.value)
    assert "fork" in msg and "open(" not in msg, msg
    assert "max_requests=3" in msg and "at most 1" in msg, msg
    assert a.open_requests == 2
    with pytest.raises(kvpool.TooManyRequestsError, match=r"open asks for 2 new requests"):
        a.open(2)  # open names itself


# ----- a state group's shortage ------------------------------------------------------------------

def test_a_state_groups_shortage_speaks_of_state_slots():
    a = GroupedAllocator(GROUPS, 4, 32)  # 2 usable state slots (slot 0 is reserved)
    with pytest.raises(kvpool.PoolExhaustedError) as info:
        a.open(3)
    msg = str(info.value)
    assert "group 1 (state)" in msg and "state slots" in msg, msg
    assert "pages" not in msg and "slots each" not in msg, msg
    assert "needs 3" in msg and "only 2" in msg, msg
    assert a.open_requests == 0
    a.check()


def test_a_page_groups_shortage_still_speaks_of_pages():
    a = GroupedAllocator([{"kind": "full", "num_pages": 3, "page_size": 4}], 4, 32)
    h = a.open(1)
    with pytest.raises(kvpool.PoolExhaustedError, match=r"group 0 \(full\).*pages \(4 slots each\)"):
        a.extend(h, 12)
