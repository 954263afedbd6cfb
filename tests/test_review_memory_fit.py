"""Review: the memory a pool plans against is the memory it allocates ("fit").

A pool sized by ``memory_bytes`` must not allocate more than the budget: every
tensor it creates (K/V, states, tables) is summed here and compared with it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
from kvpool.errors import InvalidArgumentError

HYBRID = dict(layer_types=["full_attention", "sliding_attention"], sliding_window=8)


def _hybrid_bytes(pool) -> int:
    """Every tensor a hybrid pool made: K/V, states and the padded tables."""
    return pool.nbytes + sum(t.untyped_storage().nbytes() for t in pool._tables if t is not None)


def test_hybrid_budget_with_the_primary_group_sized_by_group_pages_is_refused():
    # group_pages for the primary (full) group used to win silently over
    # memory_bytes: a 100 kB budget built a ~1.3 MB pool.
    budget = 100_000
    with pytest.raises(InvalidArgumentError, match="group_pages.*full_attention.*memory_bytes"):
        pool = kvpool.KVPool(2, 2, 8, group_pages={"full_attention": 20_000}, memory_bytes=budget,
                             max_requests=4, max_context_len=64, **HYBRID)
        assert _hybrid_bytes(pool) <= budget, _hybrid_bytes(pool)


@pytest.mark.parametrize("kw", [
    HYBRID,
    dict(HYBRID, group_pages={"sliding_attention": 40}),
    dict(layer_types=["sliding_attention"] * 3, sliding_window=8),
    dict(HYBRID, page_size={"full_attention": 4, "sliding_attention": 2}),
    dict(layer_types=["full_attention", "mamba"], state_shapes={"conv": (3, 4), "rec": ((2, 2), torch.float32)}),
], ids=["full+sliding", "sliding-sized", "sliding-only", "mixed-pages", "mamba"])
def test_hybrid_budget_covers_every_tensor(kw):
    for budget in range(40_000, 300_000, 37_111):
        pool = kvpool.KVPool(len(kw["layer_types"]), 2, 8, memory_bytes=budget, max_requests=4,
                             max_context_len=64, **kw)
        used = _hybrid_bytes(pool)
        assert used <= budget, (budget, used)


def _tp_budget_rank(rank: int, world: int) -> dict:
    import kvpool.capacity as capacity
    from kvpool.distributed import tp_pool

    # Each GPU reports its own free memory: ranks of one group see different figures.
    capacity.free_device_memory = lambda device: 400_000 + 60_000 * rank
    tp = tp_pool(2, 4, 8, dtype=torch.float16, memory_fraction=0.5, page_size=4, max_requests=4,
                 max_context_len=64, check_every=1, seed=3)
    h = tp.open(4)
    # Fill the smallest rank's pool and one page more: every rank must decide alike.
    room = (tp.num_pages - 1) * 4
    out = {"num_pages": tp.num_pages}
    try:
        tp.extend(h, [room // 4 + 1] * 4)
        out["extend"] = "ok"
    except Exception as e:  # noqa: BLE001 - the outcome is compared across ranks
        out["extend"] = type(e).__name__
    tp.verify()
    return out


def test_tp_pool_ranks_sized_by_a_budget_agree_on_capacity():
    import _dist

    res = _dist.run_ranks(_tp_budget_rank, world=2, timeout_s=90)
    assert res[0]["num_pages"] == res[1]["num_pages"], res
    assert res[0]["extend"] == res[1]["extend"] != "ok", res  # both refuse the same over-full extend


# max_requests x max_context_len past any memory while the K/V pages stay tiny: the
# request-to-token table is what does not fit (~70 TB), and only it.
HUGE_TABLE = dict(num_pages=2, page_size=1 << 16, max_requests=1 << 16, max_context_len=1 << 28)


def test_a_request_table_past_memory_is_a_typed_refusal_naming_it():
    with pytest.raises(InvalidArgumentError, match="req_to_token.*max_requests.*max_context_len"):
        kvpool.KVPool(1, 1, 8, lazy_metadata=True, **HUGE_TABLE)


def test_a_hybrid_pool_table_past_memory_is_a_typed_refusal_naming_it():
    with pytest.raises(InvalidArgumentError, match="req_to_token.*max_requests.*max_context_len"):
        kvpool.KVPool(2, 1, 8, **HYBRID, **HUGE_TABLE)


def test_a_hybrid_group_past_int32_slot_ids_is_refused_before_any_tensor(monkeypatch):
    # The plain pool refuses more than 2**31 slots at construction (capacity.MAX_SLOTS);
    # a hybrid group used to be built (K/V allocated) and refused only at its first extend.
    import kvpool.hybrid

    def allocated(**kw):
        raise AssertionError(f"K/V allocated for {kw['num_pages']} pages of {kw['page_size']}")

    monkeypatch.setattr(kvpool.hybrid, "KVStorage", allocated)
    with pytest.raises(InvalidArgumentError, match="2\\*\\*31"):
        kvpool.KVPool(2, 1, 8, page_size=1 << 16, num_pages=(1 << 15) + 1, max_requests=2, max_context_len=64,
                      **HYBRID)


def test_a_budget_past_2_53_bytes_is_divided_exactly_and_the_pages_fit_it():
    # Through float() 2**60 + 191 rounded up to 2**60, one page more than the budget holds.
    from kvpool.capacity import resolve_num_pages
    budget, page, fixed = 2**60 + 191, 2**57, 192
    pages = resolve_num_pages(page_size=1, slot_bytes=page, fixed_bytes=fixed, num_pages=None, num_slots=None,
                              memory_bytes=budget, memory_fraction=None, device=torch.device("cpu"))
    assert pages == (budget - fixed) // page == 7
    assert pages * page + fixed <= budget


@pytest.mark.parametrize("kw, hint", [
    (dict(num_pages=2**31 + 1), "use at most num_pages=2147483647"),  # the allocator takes 2**31 - 1 pages
    (dict(num_slots=2**31 + 2), "use at most num_slots=2147483647"),
    (dict(num_pages=2, page_size=2**31), "use page_size <= 1073741824"),  # no num_pages would do
    (dict(memory_bytes=2**70), "use at most memory_bytes="),  # the caller gave no num_pages
])
def test_the_slot_limit_refusal_names_a_value_that_is_taken(kw, hint):
    args = dict(max_requests=1, max_context_len=1, lazy_metadata=True) | kw
    with pytest.raises(InvalidArgumentError, match="2\\*\\*31") as err:
        kvpool.KVPool(1, 1, 1, **args)
    assert hint in str(err.value)
    if "num_pages=" in hint:  # the value named is in the allocator's range [2, 2**31 - 1] (its page ids are int32)
        assert 2 <= int(hint.rsplit("=", 1)[1]) <= 2**31 - 1


def _fraction_of_free(nbytes: int) -> np.float32:
    """The fraction of the host's free memory that is about ``nbytes`` now: a fixed fraction
    would size the pools by whatever else the machine is running."""
    from kvpool.capacity import free_device_memory
    return np.float32(min(1.0, nbytes / free_device_memory(torch.device("cpu"))))


@pytest.mark.parametrize("kw", [dict(memory_bytes=150000.0), dict(memory_bytes=np.int64(150000)),
                                "memory_fraction"])
def test_plain_and_hybrid_pools_take_the_same_budgets(kw):
    if kw == "memory_fraction":
        kw = dict(memory_fraction=_fraction_of_free(150000))
    plain = kvpool.KVPool(2, 2, 8, max_requests=4, max_context_len=64, **kw)
    hybrid = kvpool.KVPool(2, 2, 8, max_requests=4, max_context_len=64, **HYBRID, **kw)
    assert plain.allocator.num_pages >= 2 and hybrid.num_layers == 2
    for bad, what in (("1e5", "must be a number of bytes"), (True, "must be a number of bytes"),
                      (-1, "must be >= 0"), (float("inf"), "must be finite")):
        for extra in ({}, HYBRID):
            with pytest.raises(InvalidArgumentError, match=what):
                kvpool.KVPool(2, 2, 8, max_requests=4, max_context_len=64, memory_bytes=bad, **extra)


def test_host_memory_bytes_takes_the_device_budgets_rule():
    from kvpool.tiers.host_storage import host_page_bytes
    page = host_page_bytes(2, 1, 2, 8, torch.float16, mla=False)
    pool = kvpool.KVPool(2, 2, 8, num_pages=8, max_requests=4, max_context_len=64,
                         host_memory_bytes=4 * page + 0.5)  # a float, rounded down, as memory_bytes is
    assert pool.host_pages == 4
    with pytest.raises(InvalidArgumentError, match="host_memory_bytes must be a number of bytes"):
        kvpool.KVPool(2, 2, 8, num_pages=8, max_requests=4, max_context_len=64, host_memory_bytes="4096")


@pytest.mark.parametrize("kw", [dict(num_pages=2**31), dict(memory_bytes=2 * 2**31 + 1)])
def test_page_size_one_past_the_allocators_page_ids_is_refused_by_the_pool(kw):
    # 2**31 pages of one slot fit the int32 slot ids but not the allocator's page ids: the pool
    # sized them and the allocator refused, naming num_pages for a budget the caller gave.
    from kvpool.capacity import resolve_num_pages
    given = dict(num_pages=None, num_slots=None, memory_bytes=None, memory_fraction=None) | kw
    with pytest.raises(InvalidArgumentError, match="more than the 2147483647 an allocator addresses") as err:
        resolve_num_pages(page_size=1, slot_bytes=2, fixed_bytes=0, device=torch.device("cpu"), **given)
    assert ("memory_bytes=" if "memory_bytes" in kw else "num_pages=2147483647") in str(err.value)
