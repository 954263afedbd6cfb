"""KVPool.write / read check each argument once: slots the pool made itself skip the
value check while torch sees them unchanged, everything else is checked in full, and
the kernels' own argument checks are not run a second time behind the pool's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
from kvpool import ReservedSlotError, SlotRangeError
from kvpool.cuda_graph import DecodeGraphRunner

H, D = 2, 8

# These count the CPU torch path's checks. Under TRITON_INTERPRET=1 a CPU pool stores through the
# Triton kernels instead (the CUDA path), whose host slots are range-checked by design.
torch_path = pytest.mark.skipif(kvpool.kernels.INTERPRET, reason="TRITON_INTERPRET=1: CPU pools use the kernel "
                                "path, not the torch path these tests count")
# They count the core's row copy, which takes fp16 rows only through torch's DLPack exchange API;
# on a torch without it (2.4) every store goes through torch and pool-made slots are rechecked
# first (PoolSlots), by design.
row_copy = pytest.mark.skipif(not hasattr(torch._C, "_dlpack_exchange_api"),
                              reason="this torch has no DLPack C exchange API: no row copy to count")


def make_pool(layout: str = "token") -> tuple[kvpool.KVPool, np.ndarray]:
    pool = kvpool.KVPool(2, H, D, dtype=torch.float16, page_size=4, num_pages=16, max_requests=4,
                         max_context_len=16, layout=layout)
    return pool, pool.open(2)


def rows(n: int, value: float = 1.0) -> torch.Tensor:
    return torch.full((n, H, D), value, dtype=torch.float16)


def snapshot(pool: kvpool.KVPool) -> list[bytes]:
    return [t.contiguous().view(torch.uint8).numpy().tobytes() for _, t in pool.named_tensors()]


@pytest.fixture
def count(monkeypatch):
    """Calls of the value check (torch.aminmax) and of the kernels' geometry check."""
    calls = {"aminmax": 0, "cache_geom": 0}
    real_aminmax = torch.aminmax
    from kvpool.kernels import _common

    real_geom = _common.cache_geom

    def aminmax(*a, **k):
        calls["aminmax"] += 1
        return real_aminmax(*a, **k)

    def geom(*a, **k):
        calls["cache_geom"] += 1
        return real_geom(*a, **k)

    monkeypatch.setattr(torch, "aminmax", aminmax)
    monkeypatch.setattr(_common, "cache_geom", geom)
    return calls


@torch_path
@row_copy
@pytest.mark.parametrize("layout", ["token", "paged"])
def test_pool_made_slots_are_not_checked_again(count, layout):
    pool, h = make_pool(layout)
    res = pool.extend(h, [3, 2])
    count.update(aminmax=0, cache_geom=0)
    for layer in range(2):
        pool.write(layer, res.out_cache_loc, rows(5), rows(5, 2.0))
        pool.write(layer, res.slots, rows(5), rows(5, 2.0), strict=True)
    k, v = pool.read(1, res.out_cache_loc)
    assert count == {"aminmax": 0, "cache_geom": 0}
    assert torch.equal(k, rows(5)) and torch.equal(v, rows(5, 2.0))


@torch_path
@row_copy
def test_caller_made_slots_are_checked_in_full(count):
    """A list is checked in Python; a caller's CPU tensor by the core's row copy, which
    checks every value before it writes (so the Python pass is skipped for it)."""
    pool, h = make_pool()
    res = pool.extend(h, [3, 2])
    count.update(aminmax=0, cache_geom=0)
    pool.write(0, res.out_cache_loc.clone(), rows(5), rows(5))
    pool.write(0, res.slots.tolist(), rows(5), rows(5))
    assert count == {"aminmax": 1, "cache_geom": 0}
    before = snapshot(pool)
    for bad in (torch.tensor([4, pool.num_slots]), [4, pool.num_slots], torch.tensor([4, pool.num_slots]).int()):
        with pytest.raises(SlotRangeError, match=f"slots\\[1\\] = {pool.num_slots}"):
            pool.write(0, bad, rows(2, 5.0), rows(2, 5.0))
        assert snapshot(pool) == before  # the bad slot is the last: still nothing written


@pytest.mark.parametrize("mode", ["none", "inference_mode"])
def test_a_changed_pool_made_tensor_is_checked_again(mode):
    """An in-place change (under any grad mode) makes the pool's tensor an ordinary one:
    an out-of-range value is refused with nothing written, padding is skipped."""
    pool, h = make_pool()
    ctx = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with ctx:
        res = pool.extend(h, [3, 2])
        assert not res.out_cache_loc.is_inference()  # it has a version counter
        loc = res.out_cache_loc
        before = snapshot(pool)
        loc[4] = pool.num_slots
        with pytest.raises(SlotRangeError, match=f"slots\\[4\\] = {pool.num_slots}"):
            pool.write(0, loc, rows(5), rows(5))
        assert snapshot(pool) == before
        loc[4] = -1  # padding: skipped
        pool.write(0, loc, rows(5, 3.0), rows(5, 3.0))
        k, _ = pool.read(0, res.slots[:4])
        assert torch.equal(k, rows(4, 3.0))
        with pytest.raises(ReservedSlotError):
            pool.write(0, loc, rows(5), rows(5), strict=True)


def test_a_slot_changed_behind_torchs_back_is_still_a_typed_error():
    """Writes through the numpy array that shares the tensor's memory are invisible to
    torch's version counter; torch's own bounds check still refuses the slot."""
    pool, h = make_pool()
    res = pool.extend(h, [3, 2])
    before = snapshot(pool)
    res.slots[0] = pool.num_slots + 7
    with pytest.raises(SlotRangeError, match=str(pool.num_slots + 7)):
        pool.write(0, res.out_cache_loc, rows(5), rows(5))
    assert snapshot(pool) == before  # the bad slot is the first row: nothing was written


def test_only_the_last_few_results_are_remembered(count):
    pool, h = make_pool()
    first = pool.extend(h, 1)
    for _ in range(kvpool.rows.PoolSlots.SIZE):
        pool.extend(h, 1)
    count.update(aminmax=0)
    # read: a write checks a caller's tensor in the core's row copy, which aminmax does not see
    pool.read(0, first.out_cache_loc)
    assert count["aminmax"] == 1  # forgotten: checked like any caller tensor


@torch_path
@row_copy
def test_runner_slots_skip_the_second_check_but_keep_their_padding(count):
    """The graph runner (CPU: eager) checks host out_cache_loc itself and pads with
    slot 0; the step's writes then skip the value check, and strict=True still sees
    the padding."""
    pool, h = make_pool()
    res = pool.extend(h, [3, 2])
    pool.extend(h, 1)
    seen = []

    def step(ids, pos, req_rows, loc, lens):
        n = loc.shape[0]
        for layer in range(2):
            pool.write(layer, loc, rows(n, 5.0), rows(n, 6.0))
        seen.append(loc.clone())
        return ids

    runner = DecodeGraphRunner(pool, step, 4, buckets=[4])
    slots = pool.allocator.slots(int(h[0]))[-1:], pool.allocator.slots(int(h[1]))[-1:]
    loc = np.concatenate(slots)
    count.update(aminmax=0)
    runner.run(np.zeros(2, np.int64), np.zeros(2, np.int64), pool.rows(h), loc, np.ones(2, np.int64))
    assert count["aminmax"] == 0
    assert seen[0].tolist() == loc.tolist() + [0, 0]
    k, v = pool.read(1, loc)
    assert torch.equal(k, rows(2, 5.0)) and torch.equal(v, rows(2, 6.0))

    def strict_step(ids, pos, req_rows, loc, lens):
        pool.write(0, loc, rows(loc.shape[0]), rows(loc.shape[0]), strict=True)
        return ids

    strict = DecodeGraphRunner(pool, strict_step, 4, buckets=[4])
    with pytest.raises(ReservedSlotError):
        strict.run(np.zeros(2, np.int64), np.zeros(2, np.int64), pool.rows(h), loc, np.ones(2, np.int64))
    del res


def make_fp8_pool() -> tuple[kvpool.KVPool, np.ndarray]:
    pool = kvpool.KVPool(2, H, D, dtype=torch.float8_e4m3fn, page_size=4, num_pages=16, max_requests=4,
                         max_context_len=16)
    return pool, pool.open(2)


@pytest.mark.parametrize("kind", ["fp16", "fp8"])
@pytest.mark.parametrize("passed", ["slots", "out_cache_loc"])
def test_reads_of_slots_changed_behind_torchs_back_are_typed_and_read_padding_as_zeros(kind, passed):
    pool, h = make_pool() if kind == "fp16" else make_fp8_pool()
    res = pool.extend(h, [3, 2])
    pool.write(0, res.slots, rows(5, 2.0).to(pool.compute_dtype), rows(5, 3.0).to(pool.compute_dtype))
    bad = pool.num_slots + 7
    res.slots[3] = bad
    with pytest.raises(SlotRangeError, match=f"slots\\[3\\] = {bad}"):
        pool.read(0, getattr(res, passed))
    res.slots[3] = -1  # padding: reads zeros
    k, v = pool.read(0, getattr(res, passed))
    assert k[3].abs().sum() == 0 and v[3].abs().sum() == 0
    assert torch.equal(k[[0, 1, 2, 4]].float(), torch.full((4, H, D), 2.0))
    assert torch.equal(v[[0, 1, 2, 4]].float(), torch.full((4, H, D), 3.0))


@pytest.mark.parametrize("passed", ["slots", "out_cache_loc"])
def test_padding_set_behind_torchs_back_is_skipped_like_any_callers(passed):
    pool, h = make_pool()
    res = pool.extend(h, [3, 2])
    pool.write(0, res.slots, rows(5), rows(5))
    res.slots[3] = -1
    pool.write(0, getattr(res, passed), rows(5, 4.0), rows(5, 5.0))
    k, v = pool.read(0, res.slots)
    assert torch.equal(k[[0, 1, 2, 4]], rows(4, 4.0)) and torch.equal(v[[0, 1, 2, 4]], rows(4, 5.0))
    assert k[3].abs().sum() == 0  # padding reads zeros
    third = int(pool.slots(int(h[1]))[0])  # the slot the padding replaced keeps its old rows
    assert torch.equal(pool.read(0, [third])[0], rows(1))


def test_an_fp8_write_to_a_slot_changed_behind_torchs_back_is_a_typed_error():
    pool, h = make_fp8_pool()
    res = pool.extend(h, [3, 2])
    before = snapshot(pool)
    res.slots[0] = pool.num_slots + 7
    with pytest.raises(SlotRangeError, match=str(pool.num_slots + 7)):
        pool.write(0, res.out_cache_loc, rows(5).bfloat16(), rows(5).bfloat16())
    assert snapshot(pool) == before  # the bad slot is the first row: nothing was written


def _strided(n: int, value: float, dtype: torch.dtype) -> torch.Tensor:
    """Rows the core's row copy declines (every other row of a wider tensor): stored by torch."""
    return torch.full((2 * n, H, D), value, dtype=dtype)[::2]


@pytest.mark.parametrize("kind", ["fp16", "fp8"])
@pytest.mark.parametrize("source", ["contiguous", "strided"])
@pytest.mark.parametrize("edit", ["slots", "numpy", "data"])
def test_a_late_slot_changed_behind_torchs_back_writes_nothing(kind, source, edit):
    """The bad slot is the last: a store by torch (fp8's quantizing store, or index_copy_ for
    rows the core's row copy declines) used to store rows 0-3 of K before refusing it."""
    pool, h = make_pool() if kind == "fp16" else make_fp8_pool()
    res = pool.extend(h, [3, 2])
    before = snapshot(pool)
    bad = pool.num_slots + 7
    if edit == "slots":
        res.slots[4] = bad
    elif edit == "numpy":
        res.out_cache_loc.numpy()[4] = bad
    else:
        res.out_cache_loc.data[4] = bad  # .data has a version counter of its own
    dt = pool.compute_dtype
    k = rows(5, 2.0).to(dt) if source == "contiguous" else _strided(5, 2.0, dt)
    v = rows(5, 3.0).to(dt) if source == "contiguous" else _strided(5, 3.0, dt)
    for passed in ("slots", "out_cache_loc"):
        with pytest.raises(SlotRangeError, match=f"slots\\[4\\] = {bad}"):
            pool.write(1, getattr(res, passed), k, v)
        assert snapshot(pool) == before


@pytest.mark.parametrize("kind", ["fp16", "fp8"])
def test_padding_set_behind_torchs_back_is_skipped_by_the_torch_stores(kind):
    pool, h = make_pool() if kind == "fp16" else make_fp8_pool()
    res = pool.extend(h, [3, 2])
    dt = pool.compute_dtype
    pool.write(0, res.slots, rows(5).to(dt), rows(5).to(dt))
    res.slots[3] = -1
    pool.write(0, res.out_cache_loc, _strided(5, 4.0, dt), _strided(5, 5.0, dt))
    k, v = pool.read(0, res.slots)
    assert torch.equal(k[[0, 1, 2, 4]].float(), torch.full((4, H, D), 4.0))
    assert torch.equal(v[[0, 1, 2, 4]].float(), torch.full((4, H, D), 5.0))
    third = int(pool.slots(int(h[1]))[0])  # the slot the padding replaced keeps its old rows
    assert torch.equal(pool.read(0, [third])[0].float(), torch.ones(1, H, D))
