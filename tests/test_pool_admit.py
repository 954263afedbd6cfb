"""KVPool.admit(counts, tokens=): a step's new requests opened and prefilled in
one call, on the CPU shortcut (the core writes req_to_token) and on the device
path (admit_packed + update_req_to_token, run on CPU by clearing _table_np).
It must leave the pool as open + extend would, refuse bad calls without any
change, and work under every grad mode."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import kvpool
import kvpool.admission as admission_module


def make(device_path: bool) -> kvpool.KVPool:
    pool = kvpool.KVPool(1, 1, 4, num_pages=20, page_size=2, max_requests=4, max_context_len=16,
                         hash_seed=3, handle_seed=9)
    if device_path:
        pool._table_np = None  # take the off-CPU branch
    h = pool.open(2)  # in use: one request running, one closed
    pool.extend(h, [3, 2])
    pool.close(h[1:])
    return pool


def state(pool: kvpool.KVPool) -> tuple:
    a = pool.allocator
    return (a.free_pages, a.open_requests, a.used_slots, pool.req_to_token.clone().numpy().tobytes())


@pytest.mark.parametrize("device_path", [False, True], ids=["cpu-table", "device-path"])
def test_admit_leaves_the_pool_as_open_then_extend(device_path: bool) -> None:
    pool, twin = make(device_path), make(device_path)
    counts, tokens = [5, 0, 4], list(range(9))
    h, res = pool.admit(counts, tokens=tokens)
    th = twin.open(3)
    tres = twin.extend(th, counts, tokens=tokens)
    assert np.array_equal(h, th)
    assert res.slots.tolist() == tres.slots.tolist() == res.out_cache_loc.tolist()
    assert res.out_cache_loc.dtype == torch.int64
    assert torch.equal(pool.req_to_token, twin.req_to_token)
    rows = pool.rows(h)
    assert pool.req_to_token[rows[0], :5].tolist() == pool.slots(int(h[0])).tolist()
    assert pool.req_to_token[rows[2], :4].tolist() == pool.slots(int(h[2])).tolist()
    for x in h:
        assert np.array_equal(pool.known_tokens(int(x)), twin.known_tokens(int(x)))
    pool.check()


@pytest.mark.parametrize("device_path", [False, True], ids=["cpu-table", "device-path"])
@pytest.mark.parametrize(
    "counts, tokens, exc",
    [
        ([1, 1, 1, 1], None, kvpool.TooManyRequestsError),
        ([16, 16, 8], None, kvpool.PoolExhaustedError),
        ([17], None, kvpool.ContextTooLongError),
        (3, None, kvpool.InvalidArgumentError),
        ([2, -1], None, kvpool.InvalidArgumentError),
        ([2, 2], [1, 2, 3], kvpool.InvalidArgumentError),
    ],
)
def test_a_refused_admit_changes_nothing(device_path: bool, counts, tokens, exc) -> None:
    pool, twin = make(device_path), make(device_path)
    before = state(pool)
    with pytest.raises(exc):
        pool.admit(counts, tokens=tokens)
    assert state(pool) == before
    pool.check()
    assert np.array_equal(pool.open(2), twin.open(2))


def test_a_failed_device_table_update_gives_the_pages_back(monkeypatch) -> None:
    pool, twin = make(True), make(True)
    before = state(pool)

    def failing_update(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory (injected)")

    monkeypatch.setattr(admission_module, "update_req_to_token", failing_update)
    with pytest.raises(RuntimeError, match="injected"):
        pool.admit([5, 3])
    assert state(pool) == before
    pool.check()
    monkeypatch.undo()
    # The free stack is back in its old order: the retry takes the same slots as a
    # twin pool that never failed (the failed call's handles are spent).
    h, res = pool.admit([5, 3])
    _, tres = twin.admit([5, 3])
    assert res.slots.tolist() == tres.slots.tolist()
    assert torch.equal(pool.req_to_token, twin.req_to_token)
    assert pool.lengths(h).tolist() == [5, 3]


@pytest.mark.parametrize("mode", ["default", "no_grad", "inference_mode"])
def test_admit_works_under_every_grad_mode(mode: str) -> None:
    ctx = {"default": contextlib.nullcontext(), "no_grad": torch.no_grad(),
           "inference_mode": torch.inference_mode()}[mode]
    with ctx:
        pool = make(False)
        h, res = pool.admit([3, 2])
        pool.write(0, res.out_cache_loc, torch.ones(5, 1, 4, dtype=torch.float16), torch.ones(5, 1, 4, dtype=torch.float16))
    assert not pool.req_to_token.is_inference()
    assert not pool.k_buffer(0).is_inference() and not pool.k_buffer(0).requires_grad
    # Outside any mode, the pool's tensors take in-place writes made in the others.
    h2, res2 = pool.admit([1])
    pool.write(0, res2.out_cache_loc, torch.zeros(1, 1, 4, dtype=torch.float16), torch.zeros(1, 1, 4, dtype=torch.float16))
    k, _ = pool.read(0, res.slots)
    assert torch.equal(k, torch.ones(5, 1, 4, dtype=torch.float16))
