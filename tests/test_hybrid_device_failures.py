"""A hybrid pool on its device path (tables written by the kernel, as on CUDA) whose table write
or copy fails after the core committed (a CUDA OOM or launch error): the call is undone as the
plain pool undoes it, so the tables never disagree with the core and no request leaks.
No GPU: a CPU pool is put on its device path, as tests/test_hybrid_staging.py does, and the
first table write of the call is made to fail. Also: ``page_table`` goes through the ring."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_hybrid_staging import Ring, on_device_path

import kvpool.hybrid_copies
import kvpool.hybrid_tables
from kvpool import KVPool

SLIDING_FULL = ["sliding_attention", "full_attention"]


def make(types=SLIDING_FULL, **kw):
    pool = KVPool(len(types), 1, 8, layer_types=types, sliding_window=4, page_size=4, num_pages=32,
                  max_requests=4, max_context_len=32, dtype=torch.float32, **kw)
    return on_device_path(pool, Ring())


@pytest.fixture
def fail_next_table_write(monkeypatch):
    """Make the next table write of ``module`` raise, as a CUDA error would."""
    def arm(module):
        real = module.write_req_to_token
        calls = []

        def boom(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("CUDA error: out of memory (injected)")
            return real(*args, **kwargs)
        monkeypatch.setattr(module, "write_req_to_token", boom)
    return arm


def hits_and_misses(pool):
    stats = pool.stats()
    return stats["hit_tokens"], stats["miss_tokens"]


def rows_agree(pool, handles):
    for h in handles:
        row, n = int(pool.rows([h])[0]), pool.length(h)
        for layer in range(pool.num_layers):
            assert pool.req_to_token[layer][row, :n].tolist() == pool.slots(h, layer).tolist(), (h, layer)


def test_a_failed_extend_is_rolled_back_and_the_tables_agree(fail_next_table_write):
    pool = make()
    h = pool.open(2)
    pool.extend(h, [3, 6])
    before = (pool.lengths(h).tolist(), [pool.free_pages(layer) for layer in (0, 1)])
    fail_next_table_write(kvpool.hybrid_tables)
    with pytest.raises(RuntimeError, match="injected"):
        pool.extend(h, [2, 3])  # the second request's window releases a page as it grows
    assert (pool.lengths(h).tolist(), [pool.free_pages(layer) for layer in (0, 1)]) == before
    rows_agree(pool, h)
    pool.extend(h, [2, 3])  # and the same step goes through once the device is back
    rows_agree(pool, h)
    pool.check()


@pytest.mark.parametrize("call", ["fork", "admit", "open_with_prefix"])
def test_requests_opened_by_a_failed_call_are_closed_again(fail_next_table_write, call):
    pool = make()
    h = pool.open(1)
    pool.extend(h, 9, tokens=np.arange(9))
    pool.cache(h)
    before = (pool.open_requests, [pool.free_pages(layer) for layer in (0, 1)], hits_and_misses(pool))
    fail_next_table_write(kvpool.hybrid_copies if call != "admit" else kvpool.hybrid_tables)
    with pytest.raises(RuntimeError, match="injected"):
        if call == "fork":
            pool.fork(int(h[0]), 2)
        elif call == "admit":
            pool.admit([5, 6])
        else:
            pool.open_with_prefix(np.arange(12), [12])
    # An undone open served no prompt: the hit rate an engine logs does not count it.
    assert (pool.open_requests, [pool.free_pages(layer) for layer in (0, 1)], hits_and_misses(pool)) == before
    rows_agree(pool, h)
    pool.check()
    if call == "open_with_prefix":  # and the counters move again once the device is back
        pool.open_with_prefix(np.arange(12), [12])
        assert hits_and_misses(pool) == (before[2][0] + 8, before[2][1] + 4)


def test_page_table_goes_through_the_pools_ring():
    """As every other hybrid host -> device copy (it went as a pageable .to(), which waits for
    the device on CUDA). The pool is told it is on a non-CPU device, so the copy branch runs."""
    pool = make()
    h = pool.open(2)
    pool.extend(h, [5, 9])
    ring = pool._to_device
    ring.copies.clear()
    pool.device = torch.device("meta")
    table = pool.page_table(h, 1)
    assert len(ring.copies) == 1  # one staged copy of the three CSR arrays
    indptr, indices, last = pool.allocator.page_table(h, pool.group(1).index)
    assert ring.copies[0].tolist() == np.concatenate([indptr, indices, last]).tolist()
    assert table.kv_indptr.shape == indptr.shape and table.kv_indices.shape == indices.shape


def _plain_path_or_device(device_path: bool):
    pool = KVPool(2, 1, 4, layer_types=["full_attention", "sliding_attention"], sliding_window=8,
                  dtype=torch.float32, num_pages=16, page_size=4, max_requests=4, max_context_len=32)
    return on_device_path(pool, Ring()) if device_path else pool


def _fail_first_copy(monkeypatch):
    real, calls = kvpool.hybrid_copies.copy_slots, []

    def once(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory (injected)")
        return real(*a, **kw)
    monkeypatch.setattr(kvpool.hybrid_copies, "copy_slots", once)
    return calls


@pytest.mark.parametrize("device_path", [False, True], ids=["cpu", "device"])
def test_a_failed_copy_on_write_is_rolled_back_with_the_copy_made(monkeypatch, device_path):
    # CPU: the request stayed extended. Device: it was rolled back, but the copy taken from the
    # core's queue was lost, so the private page it keeps read as zeros.
    pool = _plain_path_or_device(device_path)
    h, r = pool.admit([6])
    k = torch.arange(24, dtype=torch.float32).view(6, 1, 4) + 1
    for layer in range(2):
        pool.write(layer, r.for_layer(layer).numpy(), k, -k)
    pool.fork(int(h[0]), 1)
    calls = _fail_first_copy(monkeypatch)
    with pytest.raises(RuntimeError, match="injected"):
        pool.extend(h, 1)  # into the shared, partly filled last page
    assert len(calls) >= 2 and pool.length(int(h[0])) == 6
    for layer in range(2):
        got, _ = pool.read(layer, pool.slots(int(h[0]), layer))
        assert torch.equal(got, k), layer
    pool.check()


def test_an_admit_whose_state_zeroing_fails_on_cpu_closes_its_requests(monkeypatch):
    pool = KVPool(2, 1, 4, layer_types=["linear_attention", "full_attention"], state_shapes={"s": (3,)},
                  dtype=torch.float32, num_pages=16, page_size=4, max_requests=4, max_context_len=32)
    real = kvpool.hybrid_copies.HybridCopies._copy

    def boom(self, g, *a, **kw):
        if g.kind == "state":
            raise RuntimeError("out of memory (injected)")
        return real(self, g, *a, **kw)
    monkeypatch.setattr(kvpool.hybrid_copies.HybridCopies, "_copy", boom)
    free = pool.free_pages(1)
    with pytest.raises(RuntimeError, match="injected"):
        pool.admit([5, 6])
    assert pool.open_requests == 0 and pool.free_pages(1) == free
    monkeypatch.setattr(kvpool.hybrid_copies.HybridCopies, "_copy", real)
    h, _ = pool.admit([5, 6])
    assert pool.lengths(h).tolist() == [5, 6]
    pool.check()
