"""Retention against an outside model: the eviction order (lowest priority, then least
recently used), the counts by priority, pins and unpin's answers at page sizes 1 and 16
with multi-page chains, prefix sharing, forks and truncates (tests/review_retention_model.py,
written apart from the pool's own models)."""

from __future__ import annotations

import pytest
from review_retention_model import run as run_retention

import kvpool


class UnpinMissedKeptCopies(AssertionError):
    """unpin after a truncation into a duplicate missed the kept copies (the chain
    restarted, as it did before the truncation kept it)."""


@pytest.mark.parametrize(("page_size", "num_pages", "max_pinned"),
                         [(1, 14, 3), (1, 24, 6), (1, 40, 3), (16, 6, 2), (16, 9, 1), (16, 14, 3)])
def test_eviction_follows_priorities_then_lru_with_chains_forks_and_truncates(page_size, num_pages, max_pinned):
    """Every eviction (evict(n), and pages an open or extend takes under pressure) is the
    next page of the model's order: lowest priority, then least recently used; the counts
    by priority, the pins and unpin's answers agree after every call. (Seeds 8 and 23 of
    the first two rows found the truncation below.)"""
    evicted = pressure = 0
    for seed in range(30):
        m = run_retention(seed, page_size, num_pages, max_pinned)
        evicted, pressure = evicted + m.evicted, pressure + m.pressure
    assert evicted > 100 and pressure > 10, "the traces reached eviction, under pressure too"


def duplicated_pinned_prefix():
    """Request A caches a 3-page prompt and pins it; B computed the same prompt apart,
    so its cache() kept A's copies: B's cached prefix is A's pages."""
    a = kvpool.SlotAllocator(20, 1, 8, 64, hash_seed=1, manual_clock=True, max_pinned_pages=10)
    A, _ = a.admit([3], tokens=[2000, 2001, 2002])
    a.cache(A)
    B, _ = a.admit([3], tokens=[2000, 2001, 2002])
    a.cache(B)
    a.cache(A, priority=100)
    assert a.pinned_pages == 3
    return a, A, B


@pytest.mark.parametrize("keep", [1, 2])
def test_unpin_after_a_truncation_still_reaches_the_kept_copies(keep):
    """Was: truncating B (a rollback, rejected draft tokens) where the last page it kept
    duplicated content A cached restarted B's chain, so unpin(B) returned 0 and A's pins
    stayed until B's next cache(). Now the chain resumes at the kept copy while every
    registration it went through is live: unpin(B) reaches the copies and B's next pages
    register under them."""
    a, A, B = duplicated_pinned_prefix()
    a.truncate(B, [keep])
    if a.unpin(B) != keep:
        raise UnpinMissedKeptCopies(f"unpin(B) after truncating to {keep} missed the kept copies")
    assert a.pinned_pages == 3 - keep
    a.check()
    # B's chain goes on from the kept copy: what it computes next registers under it.
    a.extend(B, [2], tokens=[7, 8])
    a.cache(B)
    a.close(A)
    h, c = a.open_with_prefix([2000, 2001, 2002][:keep] + [7, 8, 9], [keep + 3])
    assert int(c[0]) == keep + 2
    a.check()


@pytest.mark.parametrize("keep", [1, 2])
@pytest.mark.parametrize("again", [False, True])
def test_a_kept_copy_evicted_after_the_truncation_is_not_used(keep, again):
    """The kept copy is A's page, which B does not hold: A unpins and closes, eviction
    takes it, and another prompt takes the freed registrations (``again``: C computes the
    same prompt, a new registration of the same content). B's cached prefix is then what
    the index keeps now (nothing, or C's copies), never A's gone registration, and B's
    next cache() restarts its chain there: its pages register under what is live."""
    a, A, B = duplicated_pinned_prefix()
    a.truncate(B, [keep])
    a.unpin(A)
    a.close(A)
    assert a.evict(20) == 3
    C, _ = a.admit([3], tokens=[2000, 2001, 2002] if again else [50, 51, 52])
    a.cache(C, priority=100)
    a.check()
    assert a.pinned_pages == 3
    unpinned = a.unpin(B)
    if again and unpinned != keep:
        raise UnpinMissedKeptCopies(f"unpin(B) after truncating to {keep} missed C's copies")
    assert unpinned == (keep if again else 0)
    assert a.pinned_pages == 3 - unpinned
    a.extend(B, [2], tokens=[7, 8])
    a.cache(B, priority=100)
    a.check()
    # B's cached prefix: its own keep + 2 pages, or C's keep copies (pinned again) and
    # its own 2 after them.
    assert a.pinned_pages == (3 + 2 if again else 3 + keep + 2)
    a.close(B)
    a.close(C)
    h, c = a.open_with_prefix([2000, 2001, 2002][:keep] + [7, 8, 9], [keep + 3])
    assert int(c[0]) == keep + 2
    a.check()
