"""Facts docs/hybrid.md, docs/groups.md and the allocator's docstrings state that a
docs-claims sweep found missing or wrong, each pinned where it was corrected:
which plain-pool options a hybrid pool refuses (and at which values it takes them),
which checkpoints and window pages count as a request's own for a rollback, and what
unit pending_copies counts in."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool

PAGE_SIZES = (1, 16)


def _hybrid(**kw):
    return kvpool.KVPool(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu",
                         layer_types=["sliding_attention", "full_attention"], sliding_window=3, page_size=1,
                         num_pages=64, max_requests=4, max_context_len=64, **kw)


@pytest.mark.parametrize("option", [{"lazy_metadata": True}, {"manual_clock": True},
                                    {"host_policy": "write_through"}, {"host_pages": 8}])
def test_hybrid_pool_refuses_the_plain_pools_options(option):
    with pytest.raises(kvpool.InvalidArgumentError, match=next(iter(option))):
        _hybrid(**option)


def test_hybrid_pool_takes_the_values_that_ask_for_none_of_them():
    # Engine code shared by both pools may pass the plain pool's defaults (docs/hybrid.md).
    pool = _hybrid(lazy_metadata=False, manual_clock=False, host_pages=0, host_policy="write_back",
                   max_pinned_pages=None, tp_rank=0, tp_size=1)
    assert isinstance(pool, kvpool.hybrid.HybridKVPool)


def _grouped(kind: str, p: int) -> kvpool.GroupedAllocator:
    other = ({"kind": "sliding", "num_pages": 64, "page_size": p, "window": 3 * p + 1} if kind == "sliding"
             else {"kind": "state", "num_slots": 16, "checkpoint_every": 0})
    return kvpool.GroupedAllocator([{"kind": "full", "num_pages": 64, "page_size": p}, other],
                                   max_requests=4, max_context_len=256)


@pytest.mark.parametrize("kind", ["sliding", "state"])
@pytest.mark.parametrize("p", PAGE_SIZES)
def test_a_fork_rolls_back_to_what_its_parent_registered_before_the_fork(kind, p):
    # docs/groups.md, docs/hybrid.md: a request's own chain holds what its parent had
    # registered when it forked, so a beam forked after cache() can return there.
    a = _grouped(kind, p)
    toks = list(range(10, 10 + 8 * p + 1))
    h, _ = a.open_with_prefix(toks, [len(toks)])
    for _ in range(8):
        a.extend(h, p)
        a.cache(h)
    child = a.fork(h[0])
    a.truncate(child, [2 * p])
    assert a.length(child[0]) == 2 * p
    a.check()


@pytest.mark.parametrize("kind", ["sliding", "state"])
@pytest.mark.parametrize("p", PAGE_SIZES)
def test_what_the_parent_registers_after_the_fork_is_not_the_childs(kind, p):
    a = _grouped(kind, p)
    toks = list(range(10, 10 + 8 * p + 1))
    h, _ = a.open_with_prefix(toks, [len(toks)])
    a.extend(h, p)
    child = a.fork(h[0])
    for _ in range(7):
        a.extend(h, p)
        a.extend(child, p)
        a.cache(h)
    with pytest.raises(kvpool.RollbackUnavailableError):
        a.truncate(child, [2 * p])
    assert a.length(child[0]) == 8 * p
    a.truncate(h, [2 * p])  # the parent's own
    a.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_a_prefix_hit_rolls_back_to_checkpoints_on_the_prefix_it_hit(p):
    a = _grouped("state", p)
    toks = list(range(10, 10 + 4 * p + 1))
    h, _ = a.open_with_prefix(toks, [len(toks)])
    for _ in range(4):
        a.extend(h, p)
        a.cache(h)
    a.close(h)
    h, cached = a.open_with_prefix(toks, [len(toks)])
    assert int(cached[0]) == 4 * p
    a.extend(h, 1)
    a.truncate(h, [2 * p])
    assert a.length(h[0]) == 2 * p


@pytest.mark.parametrize("valid", [1, 3, 15])
def test_pending_copies_counts_the_slot_pairs_take_copies_hands_out(valid):
    a = kvpool.SlotAllocator(num_pages=16, page_size=16, max_requests=4, max_context_len=64)
    h = a.open(1)
    a.extend(h, valid)
    child = a.fork(h[0])
    a.extend(child, 1)  # copy-on-write of the shared, partly filled page
    assert a.pending_copies == valid
    src, dst = a.take_copies()
    assert len(src) == len(dst) == valid
    assert list(src) == list(a.slots(h[0]))
    assert a.pending_copies == 0
    assert np.array_equal(dst, a.slots(child[0])[:valid])


def test_the_docs_name_evicts_parameter_as_the_code_does():
    """docs/allocator.md and docs/reliability.md wrote `evict(n)` for the plain pool and
    SlotAllocator, whose parameter is n_pages: evict(n=4), as written, is a TypeError.
    (GroupedAllocator.evict(group, n) and the hybrid pool's evict(layer, n) do take n.)"""
    import inspect
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    named = {m for name in ("allocator.md", "reliability.md")
             for m in re.findall(r"`evict\((\w+)\)`", (docs / name).read_text())}
    assert named, "the docs no longer show evict's argument"
    for cls in (kvpool.SlotAllocator, kvpool.KVPool):
        assert named <= set(inspect.signature(cls.evict).parameters), (cls, named)
    assert kvpool.KVPool(1, 1, 4, num_pages=8).evict(n_pages=1) == 0
