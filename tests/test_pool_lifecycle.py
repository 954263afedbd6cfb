"""KVPool forwards the allocator's operations, queries and counters, so engines never
reach through ``pool.allocator``; every public method is documented."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import kvpool
from kvpool.lifecycle import RequestOps

COUNTERS = ["free_pages", "used_pages", "free_slots", "used_slots", "capacity_pages", "capacity_slots",
            "open_requests", "admissible_tokens", "metadata_bytes"]


def test_pool_forwards_the_allocator_through_a_lifecycle():
    pool = kvpool.KVPool(1, 1, 4, page_size=4, num_pages=10, max_requests=3, max_context_len=32)
    a = pool.allocator
    h = pool.open(2)
    pool.extend(h, [5, 2])
    for name in COUNTERS:
        assert getattr(pool, name) == getattr(a, name), name
    assert (pool.free_pages, pool.used_pages, pool.open_requests) == (6, 3, 2)
    assert pool.lengths(h).tolist() == [5, 2] and pool.length(h[0]) == 5
    assert pool.slots(h[0]).tolist() == a.slots(h[0]).tolist()
    assert pool.pages(h[1]).tolist() == a.pages(h[1]).tolist()
    assert pool.rows(h).tolist() == a.rows(h).tolist()
    assert pool.is_open(h[0]) and pool.stats().used_pages == 3
    pool.truncate(h, [1, 1])
    pool.check()
    pool.close(h[:1])
    assert not pool.is_open(h[0]) and pool.open_requests == 1
    with pytest.raises(kvpool.InvalidHandleError):
        pool.lengths(h)
    pool.reset()
    assert pool.used_pages == 0 and pool.admissible_tokens == pool.capacity_slots


@pytest.mark.parametrize("cls", [kvpool.KVPool, kvpool.SlotAllocator])
def test_every_public_method_is_documented(cls):
    missing = []
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or not (callable(member) or isinstance(member, property)):
            continue
        doc = inspect.getdoc(member) or ""
        if len(doc) < 20:
            missing.append(name)
    assert not missing, f"{cls.__name__}: undocumented public members {missing}"


def test_methods_that_can_fail_name_their_errors():
    # The pool's own calls list their errors; the calls it forwards refer to the
    # allocator's, which lists them (test_forwarding_docs.py).
    for name in ("write", "read", "k_buffer", "kv_buffer"):
        assert "Raises:" in (inspect.getdoc(getattr(kvpool.KVPool, name)) or ""), f"KVPool.{name}"
    for name in ("open", "extend", "truncate", "close", "lengths", "check"):
        assert f"SlotAllocator.{name}``" in (inspect.getdoc(getattr(RequestOps if name != "extend" else
                                                                    kvpool.KVPool, name)) or "")
    for name in ("open", "extend", "extend_packed", "truncate", "close", "lengths", "page_table", "check"):
        assert "Raises:" in (getattr(kvpool.SlotAllocator, name).__doc__ or ""), f"SlotAllocator.{name}"


def test_pool_counters_are_live():
    pool = kvpool.KVPool(1, 1, 4, num_pages=8, max_requests=2, max_context_len=16)
    before = pool.free_pages
    pool.extend(pool.open(1), np.int64(3))
    assert pool.free_pages == before - 3
