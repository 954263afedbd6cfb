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


def test_write_takes_the_plain_pools_arguments_and_errors():
    # write(..., strict=True) was a TypeError on a hybrid pool, and write(layer, slots, k) without v
    # a TypeError rather than the TensorShapeError engine code catches as an InvalidArgumentError.
    from kvpool.errors import DuplicateSlotError, ReservedSlotError, TensorShapeError

    kw = dict(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=4, num_pages=10)
    plain, hybrid = KVPool(**kw), KVPool(layer_types=["full_attention", "sliding_attention"], sliding_window=8, **kw)
    k = torch.ones(2, 1, 2)
    for pool in (plain, hybrid):
        _, res = pool.admit([2])
        loc = res.out_cache_loc if pool is plain else res.for_layer(1)
        before = [pool.read(layer, loc) for layer in (0, 1)]
        for bad, err in (([4, 4], DuplicateSlotError), ([1, 4], ReservedSlotError), ([-1, 4], ReservedSlotError)):
            with pytest.raises(err):
                pool.write(1, bad, k, k, strict=True)
        with pytest.raises(TensorShapeError, match="needs both k and v"):
            pool.write(1, loc, k)
        with pytest.raises(InvalidArgumentError, match="strict"):
            pool.write(1, loc, k, k, strict="yes")
        for layer in (0, 1):  # nothing written by any refusal
            assert all(torch.equal(a, b) for a, b in zip(pool.read(layer, loc), before[layer]))
        pool.write(1, loc, k, 2 * k, strict=True)
        got_k, got_v = pool.read(1, loc)
        assert torch.equal(got_k, k) and torch.equal(got_v, 2 * k)
