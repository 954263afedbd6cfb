"""Refusals tests/test_refusals_stateful.py found changing a pool, pinned as
explicit cases."""

from __future__ import annotations

import pytest

from kvpool import GroupedAllocator, PoolExhaustedError


def test_a_refused_sliding_extend_leaves_metadata_bytes_as_it_was():
    """A sliding group's room check sorts the pages the windows release in a
    scratch buffer that metadata_bytes counts; an extend it refused used to keep
    the buffer's growth (4157 -> 4173 bytes here), so a refusal changed what the
    pool reports, and its twin that never saw the call disagreed."""
    groups = [{"kind": "full", "num_pages": 13, "page_size": 1},
              {"kind": "sliding", "num_pages": 10, "page_size": 1, "window": 4},
              {"kind": "state", "num_slots": 9, "checkpoint_every": 0}]
    a = GroupedAllocator(groups, 6, 24, hash_seed=7, handle_seed=11)
    h = a.admit([0, 2])[0]
    a.extend(h, [0, 1])
    a.extend(h[:1], [4])
    before = (a.metadata_bytes, a.stats(), a.lengths(h).tolist(), [a.pages(x, 1).tolist() for x in h])
    with pytest.raises(PoolExhaustedError, match="group 1"):
        a.extend(h, [1, 3])  # h[0] releases one page to its window, h[1] needs three: 4 > 2 + 1
    assert (a.metadata_bytes, a.stats(), a.lengths(h).tolist(), [a.pages(x, 1).tolist() for x in h]) == before
    a.check()
    a.extend(h, [1, 2])  # the room it has: the same scratch serves a call that fits
    a.check()
