"""Numbers the allocator reports and the counters that wrap.

* ``PoolExhaustedError`` states needed and free pages *and* free slots
  (pages x page_size), as the README promises.
* ``metadata_bytes`` counts the per-request page lists, not only the fixed arrays.
* Generations and the batch epoch wrap after 2**31 / 2**32 steps; reaching
  that in a test needs the core's test-only hook that starts the counters near
  their maximum (``SlotAllocator._set_counters_for_tests``, in builds with the
  bindings' ``test-hooks`` feature: every cargo build, and CI's install; not
  the wheel). Without it these two tests skip with that reason.
"""

import numpy as np
import pytest

from kvpool import InvalidArgumentError, InvalidHandleError, PoolExhaustedError, SlotAllocator, TooManyRequestsError

MAX_GENERATION = 2**31 - 1
HOOK = "_set_counters_for_tests"


def needs_hook(a: SlotAllocator):
    hook = getattr(a, HOOK, None)
    if hook is None:
        pytest.skip(f"SlotAllocator.{HOOK}(generation=, epoch=) is not in this build (build with the test-hooks feature)")
    return hook


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_exhausted_message_states_free_pages_and_free_slots(page_size):
    a = SlotAllocator(6, page_size=page_size, max_requests=2, max_context_len=64 * page_size)
    h = a.open(2)
    a.extend(h[:1], 2 * page_size)  # 2 of 5 usable pages held, 3 free
    with pytest.raises(PoolExhaustedError) as info:
        a.extend(h[1:], 4 * page_size)
    msg = str(info.value)
    assert "needs 4 free pages" in msg and f"({page_size} slots each)" in msg
    assert "only 3 are free" in msg
    assert f"({3 * page_size} free slots;" in msg  # the page-size factor, not 3
    assert a.free_slots == 3 * page_size


def test_metadata_bytes_counts_request_page_lists():
    """Page lists live in one flat [max_requests, pages per request] array sized
    at construction: four more rows of 4096-page lists are at least 4 x 4096 u32s."""
    small = SlotAllocator(4097, page_size=1, max_requests=4, max_context_len=4096)
    big = SlotAllocator(4097, page_size=1, max_requests=8, max_context_len=4096)
    assert big.metadata_bytes - small.metadata_bytes >= 4 * 4096 * 4
    before = big.metadata_bytes
    h = big.open(2)
    big.extend(h, 2048)  # 4096 pages now listed in two requests' page lists
    big.close(h)
    # Preallocated: growth and close leave the figure where it was.
    assert big.metadata_bytes == before


def test_generation_wraps_to_a_valid_nonzero_generation():
    a = SlotAllocator(8, page_size=1, max_requests=1, max_context_len=4)
    needs_hook(a)(generation=MAX_GENERATION - 2)
    issued = []
    for _ in range(5):  # crosses MAX_GENERATION -> wrap
        try:
            h = int(a.open(1)[0])
        except TooManyRequestsError:
            # A core that retires a row instead of wrapping its generation.
            assert a.open_requests == 0
            break
        assert h >> 32 != 0, "generation 0 is never valid"
        a.extend([h], 1)
        assert a.length(h) == 1 and a.is_open(h)
        for old in issued:  # every earlier handle of this row is refused as stale
            assert not a.is_open(old)
            with pytest.raises(InvalidHandleError, match="stale"):
                a.length(old)
        a.close([h])
        issued.append(h)
        a.check()
    assert len(issued) >= 2


def test_epoch_wrap_clears_batch_stamps():
    a = SlotAllocator(16, page_size=1, max_requests=2, max_context_len=8)
    h = a.open(2)
    a.extend(h, 1)  # stamps both rows with epoch 1
    needs_hook(a)(epoch=2**32 - 1)
    for _ in range(3):  # the next batch wraps the epoch to 1 again
        a.extend(h, 1)  # a stale stamp equal to the new epoch would read as a duplicate
    assert a.lengths(h).tolist() == [4, 4]
    with pytest.raises(InvalidArgumentError, match="more than once"):
        a.extend(np.array([h[0], h[0]]), 1)  # real duplicates are still found
    a.check()


def test_reopened_row_reports_old_handle_as_stale():
    a = SlotAllocator(8, page_size=1, max_requests=1, max_context_len=4)
    old = int(a.open(1)[0])
    a.close([old])
    new = int(a.open(1)[0])
    assert new & 0xFFFFFFFF == old & 0xFFFFFFFF  # same row, newer generation
    with pytest.raises(InvalidHandleError, match="stale"):
        a.extend([old], 1)
    a.close([new])
    with pytest.raises(InvalidHandleError, match="closed"):
        a.length(new)


def _churn_prefixes(a: SlotAllocator, rounds: int, drain: bool) -> list[dict]:
    """Serves `rounds` fresh 600-token prompts through a 1000-page pool (page 1), each
    cached at close, so later ones evict earlier ones: about 1200 events a round."""
    rng = np.random.default_rng(0)
    drained = []
    for _ in range(rounds):
        prompt = rng.integers(0, 32000, 600)
        h, cached = a.open_with_prefix(prompt, [600])
        a.extend(h, 600 - int(cached[0]), tokens=prompt[int(cached[0]):])
        a.close(h, cache=True)
        if drain:
            drained.append(a.take_events())
    return drained


def test_an_undrained_event_backlog_is_bounded_and_restarts_with_a_cleared_event():
    """A pool whose events nobody drains keeps at most max(num_pages, 65536) of them:
    past that the backlog is replaced by one Cleared event (a router then forgets
    the pool's pages and relearns them), and ``dropped_events`` counts what went.
    The events after the Cleared one are exactly the newest events a pool drained
    every round reports."""
    kw = dict(page_size=1, max_requests=2, max_context_len=600, hash_seed=3)
    lazy, eager = SlotAllocator(1000, **kw), SlotAllocator(1000, **kw)
    rounds = 60  # ~72K events: past the 65536 bound once
    _churn_prefixes(lazy, rounds, drain=False)
    per_round = _churn_prefixes(eager, rounds, drain=True)
    assert eager.dropped_events == 0
    total = sum(len(e["kind"]) for e in per_round)
    assert total > 65536
    ev = lazy.take_events()
    n = len(ev["kind"])
    assert ev["kind"][0] == 2 and n <= 65536
    assert lazy.dropped_events == total - (n - 1) > 0
    tail = {k: np.concatenate([e[k] for e in per_round]) for k in ev if k != "token_ids"}
    for k, v in tail.items():
        assert np.array_equal(ev[k][1:], v[len(v) - (n - 1):]), k
    stored = int(np.sum(ev["kind"][1:] == 0))
    assert len(ev["token_ids"]) == stored, "the dropped events' token ids went with them"
    # Drained, the log starts afresh; the count stays (it is cumulative).
    assert len(lazy.take_events()["kind"]) == 0
    assert lazy.dropped_events == total - (n - 1)


@pytest.mark.parametrize(("pages", "page_size", "rows", "ctx"), [(4096, 16, 64, 3000), (1000, 1, 8, 100), (65536, 16, 256, 4096),
                                                              (5, 16, 4, 64)])  # the smallest the docs' sum is exact for
def test_metadata_bytes_of_a_new_allocator_is_the_documented_sum(pages, page_size, rows, ctx):
    """docs/allocator.md, *Memory*: 20 bytes a page (page 0 has no free-stack entry) and 4 per
    block of eight pages (rounded up), 4 a slot, per row 16 + 80 + 4 + 4 + 4 x (page list:
    ceil(ctx / page_size) rounded up to 16, plus 16), and 512 bytes once."""
    a = SlotAllocator(pages, page_size=page_size, max_requests=rows, max_context_len=ctx)
    page_list = -(-ctx // page_size)
    page_list = -(-page_list // 16) * 16 + 16
    want = pages * 20 - 4 + -(-pages // 8) * 4 + pages * page_size * 4 + rows * (16 + 80 + 4 + 4 + 4 * page_list) + 512
    assert a.metadata_bytes == want


@pytest.mark.parametrize(("pages", "rows"), [(2, 1), (4, 3), (5, 1), (2, 8)])
def test_a_tiny_allocator_counts_at_most_24_bytes_past_the_documented_sum(pages, rows):
    """docs/allocator.md: below four rows or five pages a reserved array still holds four entries."""
    a = SlotAllocator(pages, page_size=1, max_requests=rows, max_context_len=1)
    want = pages * 20 - 4 + -(-pages // 8) * 4 + pages * 4 + rows * (16 + 80 + 4 + 4 + 4 * 32) + 512
    assert want < a.metadata_bytes <= want + 24
