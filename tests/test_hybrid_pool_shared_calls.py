"""A hybrid pool answers the calls engine code shares with the plain pool as the plain pool
does: admit's refusal of a single int, and the counters an engine logs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_hybrid_pool import make

from kvpool import KVPool
from kvpool._core import InvalidArgumentError
from kvpool.errors import LayerIndexError


@pytest.mark.parametrize("single", [3, np.int64(3), np.array(3)], ids=["int", "np.int64", "0-d"])
def test_admit_refuses_a_single_int_as_the_plain_pool_does(single):
    # admit(3) could mean one request of 3 tokens or 3 requests: every pool kind refuses it the same way,
    # so engine code shared by plain and hybrid pools cannot open the wrong number of requests.
    plain = KVPool(2, 2, 8, dtype=torch.float32, num_pages=16, page_size=4, max_requests=4, max_context_len=32)
    hybrid = make()
    for target in (plain, plain.allocator, hybrid, hybrid.allocator):
        with pytest.raises(InvalidArgumentError, match=r"got the single int 3: pass \[3\] to admit one request"):
            target.admit(single)
        assert target.open_requests == 0
    handles, _ = hybrid.admit([3])
    assert list(hybrid.lengths(handles)) == [3]


def test_counters_an_engine_logs_read_as_the_grouped_allocator_reports_them():
    # Engine code shared with the plain pool reads stats(), metadata_bytes, dropped_events and
    # evictable pages; on a hybrid pool they were AttributeErrors.
    pool = make()
    h, _ = pool.admit([10], tokens=list(range(10)))
    pool.close(h, cache=True)
    s = pool.stats()
    assert s == pool.allocator.stats() and s["open_requests"] == 0
    assert len(s["groups"]) == len(pool.groups)
    for layer in (0, 1, 3):  # attention layers: their group's evictable pages
        g = pool.group(layer).index
        assert pool.evictable_pages(layer) == s["groups"][g]["evictable_pages"]
    assert sum(x["evictable_pages"] for x in s["groups"]) > 0
    assert pool.metadata_bytes == pool.allocator.metadata_bytes > 0
    assert pool.dropped_events == 0
    with pytest.raises(LayerIndexError):
        pool.evictable_pages(4)
