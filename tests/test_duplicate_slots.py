"""Slots named twice in one call (issue: CPU and GPU can disagree). On a GPU the rows
race, so: copy_slots rejects overlapping host pairs (duplicate destinations, a
destination that is also a source); a strict pool.write rejects repeated host slots;
the non-strict write keeps accepting repeats (padding repeats slot 0 by design)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
import kvpool.kernels as K
from kvpool import DuplicateSlotError


def _caches():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn((16, 2, 4), generator=gen) for _ in range(3)]


@pytest.mark.parametrize("src,dst,match", [
    ([1, 2], [5, 5], "more than once"),
    ([1, 5], [5, 6], "both a destination and a source"),
    ([1, 2, 3], [4, 1, 9], "both a destination and a source"),
])
def test_copy_slots_rejects_overlapping_pairs_and_copies_nothing(src, dst, match):
    caches = _caches()
    before = [c.clone() for c in caches]
    with pytest.raises(DuplicateSlotError, match=match):
        K.copy_slots(caches, torch.tensor(src), torch.tensor(dst))
    assert all(torch.equal(a, b) for a, b in zip(caches, before))
    assert issubclass(DuplicateSlotError, kvpool.InvalidArgumentError)


def test_copy_slots_skipped_pairs_do_not_count_as_overlap():
    caches = _caches()
    want = [c.clone() for c in caches]
    for w in want:
        w[[7, 8]] = w[[1, 2]]
    # -1 pairs are skipped: their other half may repeat a used slot.
    K.copy_slots(caches, torch.tensor([1, 2, -1, 7]), torch.tensor([7, 8, 8, -1]))
    assert all(torch.equal(a, b) for a, b in zip(caches, want))


def test_strict_write_rejects_repeated_host_slots_unchanged():
    pool = kvpool.KVPool(1, 2, 4, num_pages=8, page_size=2, max_requests=2, max_context_len=8)
    before = [t.clone() for t in pool.k_buffers + pool.v_buffers]
    k = torch.ones((3, 2, 4), dtype=torch.float16)
    with pytest.raises(DuplicateSlotError, match="more than once"):
        pool.write(0, np.array([4, 5, 4]), k, k, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k_buffers + pool.v_buffers))
    pool.write(0, np.array([0, 0, 4]), k, k)  # non-strict: padding may repeat slot 0
    assert torch.equal(pool.read(0, [4])[0], k[2:])
