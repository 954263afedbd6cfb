"""Keyword flags (close's cache, extend's cow, SlotAllocator's kv_events)
take True or False, numpy bools included. Anything else is an
InvalidArgumentError that names the flag, with nothing changed: not
pyo3's untyped TypeError, and not a truthiness guess (1, "no", None)."""

import numpy as np
import pytest
import torch

import kvpool
from kvpool import InvalidArgumentError, SlotAllocator

NOT_BOOLS = [1, 0, None, "yes", 1.0, np.int64(1), [True], torch.tensor(True)]


def pool_state(a, h):
    return (a.free_pages, a.cached_pages, a.open_requests, a.pending_copies, a.lengths(h).tolist())


@pytest.mark.parametrize("bad", NOT_BOOLS, ids=repr)
def test_a_flag_that_is_not_a_bool_is_refused_by_name(bad):
    a = SlotAllocator(16, page_size=2, max_requests=4, max_context_len=16)
    h, _ = a.open_with_prefix([5, 6, 7], [3])
    a.extend(h, 3)
    h = np.concatenate([h, a.fork(h[0], 1)])  # sharing a half-full page
    before = pool_state(a, h)
    calls = {
        "cache": [lambda: a.close(h[:1], cache=bad), lambda: a.close(h[:1], bad)],
        "cow": [lambda: a.extend(h, 1, cow=bad)],
        "kv_events": [lambda: SlotAllocator(16, kv_events=bad)],
    }
    for name, variants in calls.items():
        for call in variants:
            with pytest.raises(InvalidArgumentError, match=rf"^{name} takes True or False, got "):
                call()
    assert pool_state(a, h) == before
    a.check()


def test_numpy_bools_are_flags():
    a = SlotAllocator(16, page_size=2, max_requests=4, max_context_len=16, kv_events=np.False_)
    h, _ = a.open_with_prefix([5, 6, 7], [3])
    a.extend(h, 3)
    kid = a.fork(h[0], 1)
    slots, cow = a.extend(kid, 1, cow=np.True_)  # the shared half page is copied
    assert cow.tolist() == [1, 2, int(a.slots(h[0])[2]), int(slots[0]) - 1]
    assert a.extend(h, 1, cow=np.False_).size == 1
    a.close(h, cache=np.True_)
    assert a.cached_pages == 1 and a.take_events()["kind"].size == 0
    a.close(kid, cache=np.bool_(False))
    a.check()


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
def test_kvpool_close_gives_the_same_typed_error(hybrid):
    kw = dict(layer_types=["full_attention"]) if hybrid else {}
    pool = kvpool.KVPool(1, 1, 2, dtype=torch.float32, page_size=2, num_pages=8, max_requests=4, max_context_len=8,
                         **kw)
    h, _ = pool.admit([3])
    # (arrays: the pool's own `if cache:` raised numpy's / torch's untyped truth-value error)
    for bad in (1, None, np.array([True, False]), torch.tensor([1, 1]), np.ones(2)):
        with pytest.raises(InvalidArgumentError, match="^cache takes True or False"):
            pool.close(h, cache=bad)
    assert pool.open_requests == 1
    pool.close(h, cache=True)
    assert pool.open_requests == 0


def test_kvpool_write_strict_is_a_flag_too():
    pool = kvpool.KVPool(1, 1, 2, dtype=torch.float32, page_size=2, num_pages=8, max_requests=4, max_context_len=8)
    _, res = pool.admit([2])
    rows = torch.ones(2, 1, 2)
    before = pool.k_buffer(0).clone()
    for bad in NOT_BOOLS:
        with pytest.raises(InvalidArgumentError, match="^strict takes True or False, got "):
            pool.write(0, res.out_cache_loc, rows, rows, strict=bad)
        assert torch.equal(pool.k_buffer(0), before)
    pool.write(0, res.out_cache_loc, rows, rows, strict=np.True_)
    assert torch.equal(pool.read(0, res.out_cache_loc)[0], rows)
