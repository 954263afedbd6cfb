"""uint32 arguments with values >= 2**31 mean the same as their int64 form:
the same result, or the same error (type and message), for every integer
argument of the bindings, as numpy arrays (contiguous or strided), numpy
scalars and CPU torch tensors. A reader that took them as int32 would wrap
2**31 + k to a negative number and answer another question."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool import KVPoolError, SlotAllocator

BIG = 2**31


def uint32_forms(values: list[int]) -> dict:
    strided = np.zeros(2 * len(values), dtype=np.uint32)
    strided[::2] = values
    return {
        "numpy": np.array(values, dtype=np.uint32),
        "numpy-strided": strided[::2],
        "torch": torch.tensor(values, dtype=torch.uint32),
    }


def twin_pools():
    """Two identical pools (same seeds), each with three open requests."""
    pools = []
    for _ in range(2):
        a = SlotAllocator(64, page_size=4, max_requests=8, max_context_len=64, hash_seed=5, handle_seed=6)
        h = a.open(3)
        a.extend(h, [1, 5, 4])
        pools.append((a, h))
    return pools


def answer(call):
    """What a call gives: its result, or its error's type and message."""
    try:
        r = call()
    except KVPoolError as e:
        return type(e).__name__, str(e)
    if isinstance(r, tuple):
        return tuple(x.tolist() if isinstance(x, np.ndarray) else x for x in r)
    return r.tolist() if isinstance(r, np.ndarray) else r


def state(a, h):
    return a.free_pages, a.open_requests, a.cached_pages, a.lengths(h).tolist()


# Each call takes the pool, its handles and the argument under test (a
# value list), in either form.
CALLS = {
    "extend handles": ([BIG + 1], lambda a, h, v: a.extend(v, 1)),
    "lengths handles": ([BIG + 2, BIG], lambda a, h, v: a.lengths(v)),
    "rows handles": ([BIG + 2], lambda a, h, v: a.rows(v)),
    "page_table handles": ([2**32 - 1], lambda a, h, v: a.page_table(v)),
    "close handles": ([BIG + 3], lambda a, h, v: a.close(v)),
    "cache handles": ([BIG + 3], lambda a, h, v: a.cache(v)),
    "truncate handles": ([BIG + 3], lambda a, h, v: a.truncate(v, 0)),
    "extend counts": ([1, BIG, 1], lambda a, h, v: a.extend(h, v)),
    "extend_packed counts": ([1, BIG + 5, 1], lambda a, h, v: a.extend_packed(h, v)),
    "admit counts": ([2, BIG], lambda a, h, v: a.admit(v)),
    "truncate lengths": ([0, BIG, 0], lambda a, h, v: a.truncate(h, v)),
    "extend tokens": ([7, BIG + 7], lambda a, h, v: a.extend(h[:1], 2, tokens=v)),
    "open_with_prefix tokens": ([1, 2, BIG + 3], lambda a, h, v: a.open_with_prefix(v, [3])),
    "open_with_prefix lengths": ([BIG], lambda a, h, v: a.open_with_prefix([1, 2], v)),
    "match_chain_hashes tokens": (
        [1, 2, 3, BIG + 4],
        lambda a, h, v: a.match_chain_hashes(np.zeros(2, np.uint64), v),
    ),
}


@pytest.mark.parametrize("form", ["numpy", "numpy-strided", "torch"])
@pytest.mark.parametrize("name", CALLS)
def test_uint32_past_int32_means_what_its_int64_form_means(name: str, form: str) -> None:
    values, call = CALLS[name]
    (a, ha), (b, hb) = twin_pools()
    want = answer(lambda: call(b, hb, np.array(values, dtype=np.int64)))
    got = answer(lambda: call(a, ha, uint32_forms(values)[form]))
    assert got == want
    assert isinstance(want, tuple) and want[0].endswith("Error"), want  # each case is refused
    assert state(a, ha) == state(b, hb)
    a.check()


@pytest.mark.parametrize("form", ["numpy", "torch"])
def test_a_salt_past_int32_keys_the_cache_like_its_int64_form(form: str) -> None:
    # A salt is any int64: BIG + 3 read as int32 would be another salt, and
    # the prompt would neither share the pages nor hash the same.
    (a, _), (b, _) = twin_pools()
    prompt = list(range(100, 109))
    for pool, salt in ((a, uint32_forms([BIG + 3])[form]), (b, np.array([BIG + 3]))):
        h, cached = pool.open_with_prefix(prompt, [9], salt=salt)
        assert cached.tolist() == [0]
        pool.extend(h, 9)
        pool.close(h, cache=True)
    for pool in (a, b):
        _, cached = pool.open_with_prefix(prompt, [9], salt=BIG + 3)
        assert cached.tolist() == [8], "the same salt hits"
    ev_a, ev_b = a.take_events(), b.take_events()
    assert ev_a["salt"].tolist() == [BIG + 3, BIG + 3] == ev_b["salt"].tolist()
    assert ev_a["hash_lo"].tolist() == ev_b["hash_lo"].tolist()


def test_numpy_uint32_scalars_are_the_same_handles() -> None:
    (a, _), (b, _) = twin_pools()
    for v in (BIG + 9, 2**32 - 1):
        assert answer(lambda: a.length(np.uint32(v))) == answer(lambda: b.length(v))
        assert answer(lambda: a.slots(np.uint32(v))) == answer(lambda: b.slots(v))
        assert answer(lambda: a.fork(np.uint32(v))) == answer(lambda: b.fork(v))
