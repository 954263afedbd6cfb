"""Outside-style refusals of a KVPool's host-tier calls (swap_out, swap_in, is_swapped,
evict, and the calls a swapped request refuses): every bad input raises a kvpool error
of the documented class (docs/errors.md), says something, and leaves the pool exactly
as it was: counters, priorities, queues, each request's place, row, slots and known
tokens, every tensor's bytes (host storage and req_to_token included), no KV event,
``check()`` passing. Ints given as numpy ints or 0-d tensors are accepted and do what
the plain int does (a twin pool built with the same seeds makes the plain calls).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _once_index import OnceIndex
from _outside_host_tier import LAYERS, D, H, assert_holds, assert_refused_cleanly, no_events, state, write_positions

import kvpool

PS = 4


def make(host_pages=10, num_pages=10, seed=5):
    return kvpool.KVPool(LAYERS, H, D, dtype=torch.float32, page_size=PS, num_pages=num_pages, max_requests=6,
                         max_context_len=48, host_pages=host_pages, hash_seed=3, handle_seed=seed)


def serve(pool, prompt, salt=0):
    hs, cached = pool.open_with_prefix(prompt, [len(prompt)], salt)
    r = pool.extend(hs, [len(prompt) - int(cached[0])])
    write_positions(pool, r.slots, prompt, salt, int(cached[0]))
    return int(hs[0])


P_A, P_B, P_S = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 10, 11], [20, 21, 22, 23, 24, 25, 26]


def scene(pool):
    """a: resident; b: resident, sharing a's first page (a cached prefix); s: swapped out;
    stale: a closed request's handle."""
    a = serve(pool, P_A)
    pool.cache([a])
    b = serve(pool, P_B)
    s = serve(pool, P_S)
    pool.swap_out([s])
    gone = serve(pool, [30, 31])
    pool.close([gone])
    return a, b, s, gone


@pytest.fixture
def world():
    pool = make()
    a, b, s, gone = scene(pool)
    foreign = make(seed=99)
    f = serve(foreign, [40, 41, 42])
    return pool, (a, b, s), gone, f


def bad_calls(pool, a, b, s, gone, f):
    return [
        # handles that are not requests of this pool
        ("swap_out stale", lambda: pool.swap_out([gone]), kvpool.InvalidHandleError),
        ("swap_in stale", lambda: pool.swap_in([gone]), kvpool.InvalidHandleError),
        ("swap_out foreign", lambda: pool.swap_out([f]), kvpool.InvalidHandleError),
        ("swap_in foreign", lambda: pool.swap_in([f]), kvpool.InvalidHandleError),
        ("swap_out stale after a valid one", lambda: pool.swap_out([a, gone]), kvpool.InvalidHandleError),
        ("swap_in stale after a valid one", lambda: pool.swap_in([s, gone]), kvpool.InvalidHandleError),
        ("is_swapped stale", lambda: pool.is_swapped(gone), kvpool.InvalidHandleError),
        ("is_swapped foreign", lambda: pool.is_swapped(f), kvpool.InvalidHandleError),
        ("swap_out negative", lambda: pool.swap_out([-1]), kvpool.InvalidHandleError),
        # a handle twice; the wrong side of the swap
        ("swap_out twice", lambda: pool.swap_out([a, b, a]), kvpool.InvalidArgumentError),
        ("swap_in twice", lambda: pool.swap_in([s, s]), kvpool.InvalidArgumentError),
        ("swap_in resident", lambda: pool.swap_in([a]), kvpool.InvalidArgumentError),
        ("swap_in swapped then resident", lambda: pool.swap_in([s, b]), kvpool.InvalidArgumentError),
        ("swap_out swapped", lambda: pool.swap_out([s]), kvpool.RequestSwappedOutError),
        ("swap_out resident then swapped", lambda: pool.swap_out([a, s]), kvpool.RequestSwappedOutError),
        # what a swapped request refuses
        ("extend swapped", lambda: pool.extend([a, s], [1, 1]), kvpool.RequestSwappedOutError),
        ("truncate swapped", lambda: pool.truncate([s], [1]), kvpool.RequestSwappedOutError),
        ("fork swapped", lambda: pool.fork(s, 1), kvpool.RequestSwappedOutError),
        ("cache swapped", lambda: pool.cache([a, s]), kvpool.RequestSwappedOutError),
        ("close(cache=True) swapped", lambda: pool.close([a, s], cache=True), kvpool.RequestSwappedOutError),
        ("unpin swapped", lambda: pool.unpin([s]), kvpool.RequestSwappedOutError),
        ("slots swapped", lambda: pool.slots(s), kvpool.RequestSwappedOutError),
        ("pages swapped", lambda: pool.pages(s), kvpool.RequestSwappedOutError),
        ("page_table swapped", lambda: pool.page_table([a, s]), kvpool.RequestSwappedOutError),
        # handles of the wrong kind
        ("swap_out float", lambda: pool.swap_out(np.array([float(a)])), kvpool.InvalidArgumentError),
        ("swap_out float tensor", lambda: pool.swap_out(torch.tensor([1.0])), kvpool.InvalidArgumentError),
        ("swap_out bool", lambda: pool.swap_out(np.array([True])), kvpool.InvalidArgumentError),
        ("swap_out 2-D", lambda: pool.swap_out(np.array([[a]])), kvpool.InvalidArgumentError),
        ("swap_in 2-D tensor", lambda: pool.swap_in(torch.tensor([[s]])), kvpool.InvalidArgumentError),
        ("swap_out None", lambda: pool.swap_out(None), kvpool.InvalidArgumentError),
        ("swap_in str", lambda: pool.swap_in("s"), kvpool.InvalidArgumentError),
        ("swap_out past int64", lambda: pool.swap_out([2 ** 64]), kvpool.InvalidArgumentError),
        ("swap_in uint64 past int64", lambda: pool.swap_in(np.array([2 ** 64 - 1], dtype=np.uint64)),
         kvpool.InvalidArgumentError),
        ("is_swapped float", lambda: pool.is_swapped(1.5), kvpool.InvalidArgumentError),
        # counts
        ("evict negative", lambda: pool.evict(-1), kvpool.InvalidArgumentError),
        ("evict past int64", lambda: pool.evict(2 ** 63), kvpool.InvalidArgumentError),
        ("evict float", lambda: pool.evict(1.0), kvpool.InvalidArgumentError),
        ("evict bool", lambda: pool.evict(True), kvpool.InvalidArgumentError),
        ("evict None", lambda: pool.evict(None), kvpool.InvalidArgumentError),
        ("evict numpy negative", lambda: pool.evict(np.int64(-3)), kvpool.InvalidArgumentError),
        ("evict 0-d tensor negative", lambda: pool.evict(torch.tensor(-3)), kvpool.InvalidArgumentError),
        ("fork numpy negative", lambda: pool.fork(a, np.int64(-1)), kvpool.InvalidArgumentError),
    ]


CASES = [name for name, _, _ in bad_calls(*([None] * 6))]


@pytest.mark.parametrize("name", CASES)
def test_a_bad_host_tier_call_is_typed_and_changes_nothing(world, name):
    pool, (a, b, s), gone, f = world
    call, err = next((c, e) for n, c, e in bad_calls(pool, a, b, s, gone, f) if n == name)
    assert_refused_cleanly(pool, [a, b, s, gone], call, err)
    # And the pool still works: s comes back holding what it wrote.
    pool.swap_in([s])
    assert_holds(pool, s, P_S, 0)
    assert_holds(pool, a, P_A, 0)
    assert_holds(pool, b, P_B, 0)


def test_too_few_host_pages_for_the_batch_refuses_all_of_it():
    """Each request alone fits the host; together they do not: nothing moves."""
    pool = make(host_pages=4)  # 3 usable host pages
    a = serve(pool, [50 + i for i in range(8)])  # 2 pages
    b = serve(pool, [70 + i for i in range(8)])  # 2 pages
    err = assert_refused_cleanly(pool, [a, b], lambda: pool.swap_out([a, b]), kvpool.PoolExhaustedError)
    assert "host" in str(err)
    pool.swap_out([a])
    assert_refused_cleanly(pool, [a, b], lambda: pool.swap_out([b]), kvpool.PoolExhaustedError)
    pool.swap_in([a])
    assert_holds(pool, a, [50 + i for i in range(8)], 0)
    assert_holds(pool, b, [70 + i for i in range(8)], 0)


def test_too_few_device_pages_for_the_batch_refuses_all_of_it():
    """swap_in of two requests where the first would fit alone: neither comes back."""
    pool = make(num_pages=6, host_pages=12)  # 5 usable device pages
    pa, pb = [50 + i for i in range(8)], [70 + i for i in range(8)]
    a, b = serve(pool, pa), serve(pool, pb)
    pool.swap_out([a, b])
    c = serve(pool, [90 + i for i in range(12)])  # 3 of the 5 pages held: room for one request
    hs = [a, b, c]
    err = assert_refused_cleanly(pool, hs, lambda: pool.swap_in([a, b]), kvpool.PoolExhaustedError)
    assert "free" in str(err)
    pool.swap_in([b])
    assert_holds(pool, b, pb, 0)
    assert pool.is_swapped(a)
    pool.close([c])
    pool.swap_in([a])
    assert_holds(pool, a, pa, 0)


FORMS = {"numpy int64": np.int64, "numpy uint64": np.uint64, "0-d tensor": torch.tensor}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_numpy_ints_and_0_d_tensors_are_handles_and_counts(form):
    """A handle or count given as a numpy int or a 0-d tensor does what the int does."""
    conv = FORMS[form]
    plain, other = make(), make()
    hs = scene(plain)
    assert scene(other) == hs  # (same seeds: same handles)
    a, b, s, _ = hs
    steps = [
        lambda p, c: p.swap_out(c(b)),
        lambda p, c: p.is_swapped(c(b)),
        lambda p, c: p.swap_in(c(s)),
        lambda p, c: p.evict(c(2)),
        lambda p, c: p.swap_in([c(b)]),
        lambda p, c: p.fork(c(a), c(1)),
        lambda p, c: p.swap_out([c(a), c(s)]),
    ]
    for step in steps:
        want = step(plain, int)
        got = step(other, conv)
        assert np.array_equal(np.asarray(want), np.asarray(got))
        assert plain.take_events().keys() == other.take_events().keys()
        # (all but the tensors' bytes: slots never written hold whatever torch.empty gave)
        assert state(plain, [a, b, s])[:-1] == state(other, [a, b, s])[:-1]
        other.check()
    other.swap_in([conv(a), conv(s)])
    for h, prompt in ((a, P_A), (b, P_B), (s, P_S)):
        assert_holds(other, h, prompt, 0)


HANDLE_CALLS = {
    "swap_out": (lambda p, a, s, c: p.swap_out([c(a)])),
    "swap_in": (lambda p, a, s, c: p.swap_in([c(s)])),
    "close a swapped request": (lambda p, a, s, c: p.close([c(s)])),
    "close(cache=True)": (lambda p, a, s, c: p.close([c(a)], cache=True)),
    "truncate": (lambda p, a, s, c: p.truncate([c(a)], [5])),
    "fork": (lambda p, a, s, c: p.fork(c(a), 1)),
}


@pytest.mark.parametrize("call", sorted(HANDLE_CALLS))
def test_a_handle_s_own_conversion_code_runs_once(call):
    """An element whose ``__index__`` answers once and then raises: the call does what the
    int does (the pool converts each handle once, before anything changes), never commits
    and then raises from a second conversion; one that raises at once is refused typed
    (an ``Exception``) or passed through (a ``KeyboardInterrupt``), the pool unchanged."""
    run = HANDLE_CALLS[call]
    plain, other = make(), make()
    hs = scene(plain)
    assert scene(other) == hs
    a, b, s, _ = hs
    run(plain, a, s, int)
    for exc in (ValueError("flaky"), KeyboardInterrupt()):
        run(other, a, s, lambda h, exc=exc: OnceIndex(h, 1, exc))
        plain.take_events()
        other.take_events()
        assert state(plain, [a, b, s])[:-1] == state(other, [a, b, s])[:-1]
        other.check()
        other = make()
        assert scene(other) == hs
    for exc, err in ((ValueError("flaky"), kvpool.InvalidArgumentError), (KeyboardInterrupt(), KeyboardInterrupt)):
        other.take_events()
        before = state(other, [a, b, s])
        with pytest.raises(err):
            run(other, a, s, lambda h, exc=exc: OnceIndex(h, 0, exc))
        assert state(other, [a, b, s]) == before
        assert no_events(other.take_events())
        other.check()
