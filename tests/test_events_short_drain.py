"""``take_events`` when fewer events fit its arrays than it counted.

``take_events`` sizes its numpy arrays by the pending count, then drains into them
under the pool's lock. If an overflow replaced the backlog in between, fewer events
come out than were counted: the oldest that fit are returned (as a dict built from
them), and the rest stay in the pool, in order, for the next drain. That race needs
another thread between two calls under one lock; the test-only hook
``SlotAllocator._take_events_sized_for_tests(events, tokens)`` (builds with the
bindings' ``test-hooks`` feature: every cargo build, and CI's install; not the wheel)
sizes the arrays short on purpose, so the same path runs here.
"""

import numpy as np
import pytest

from kvpool import SlotAllocator

HOOK = "_take_events_sized_for_tests"
FIELDS = ("kind", "hash_hi", "hash_lo", "parent_hi", "parent_lo", "page", "num_tokens", "salt", "token_ids", "medium")


def needs_hook(a: SlotAllocator):
    hook = getattr(a, HOOK, None)
    if hook is None:
        pytest.skip(f"SlotAllocator.{HOOK}(events, tokens) is not in this build (build with the test-hooks feature)")
    return hook


def pool_with_events(page_size: int) -> SlotAllocator:
    """A pool whose backlog holds Stored events of whole pages, Removed events and the
    Stored events of chains registered again, the same on every call."""
    a = SlotAllocator(9, page_size=page_size, max_requests=4, max_context_len=64 * page_size,
                      hash_seed=11, handle_seed=5)
    rng = np.random.default_rng(3)
    for _ in range(4):
        prompt = rng.integers(0, 1000, size=3 * page_size).astype(np.int64)
        h, _ = a.open_with_prefix(prompt, np.array([len(prompt)], dtype=np.int64))
        a.extend(h, len(prompt) - int(a.lengths(h)[0]))
        a.cache(h)
        a.close(h, cache=True)  # 8 usable pages: later chains evict earlier ones
    return a


def concat(parts):
    return {f: np.concatenate([p[f] for p in parts]) for f in FIELDS}


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("events,tokens", [(0, 0), (1, 10**6), (5, 10**6), (10**6, 6), (3, 3), (10**6, 10**6)])
def test_a_short_drain_returns_the_oldest_events_and_keeps_the_rest(page_size, events, tokens):
    whole = pool_with_events(page_size).take_events()
    n = len(whole["kind"])
    assert n > 8 and 1 in whole["kind"]  # Stored and Removed events both

    a = pool_with_events(page_size)
    short = needs_hook(a)(events, tokens)
    m = len(short["kind"])
    # The oldest events that fit: at most `events`, and no more token ids than `tokens`.
    assert m <= min(events, n)
    assert len(short["token_ids"]) <= tokens
    assert int(short["num_tokens"].sum()) == len(short["token_ids"])
    if events >= n and tokens >= len(whole["token_ids"]):
        assert m == n
    else:
        assert m < n  # the short path ran
        # Stopped where the next event would not fit.
        nt = whole["num_tokens"]
        assert m == min(events, n) or int(nt[: m + 1].sum()) > tokens
    for f in FIELDS:
        assert short[f].dtype == whole[f].dtype, f
    rest = a.take_events()
    got = concat([short, rest])
    for f in FIELDS:
        np.testing.assert_array_equal(got[f], whole[f], err_msg=f)
    assert len(a.take_events()["kind"]) == 0
