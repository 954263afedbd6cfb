"""extend off CPU is atomic: when the req_to_token update fails after the
allocator committed (a CUDA OOM or launch error; injected here), the pool
rolls the allocator back and is exactly as before the call.

The device path runs on CPU by clearing ``_table_np`` (the CPU shortcut that
lets the core write the table itself); the update is then the same
``extend_packed`` + ``update_req_to_token`` sequence a CUDA pool runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
import kvpool.extending as pool_module


def device_path_pool() -> kvpool.KVPool:
    pool = kvpool.KVPool(1, 1, 4, num_pages=20, page_size=2, max_requests=4, max_context_len=16)
    pool._table_np = None  # take the off-CPU branch of extend
    return pool


def state(pool: kvpool.KVPool, h: np.ndarray) -> tuple:
    a = pool.allocator
    return (a.free_pages, a.open_requests, a.lengths(h).tolist(), [a.slots(x).tolist() for x in h],
            pool.req_to_token.clone().numpy().tobytes())


def test_device_path_writes_the_table():
    pool = device_path_pool()
    h = pool.open(2)
    res = pool.extend(h, [3, 2])
    assert res.slots.tolist() == [2, 3, 4, 6, 7] and res.out_cache_loc.tolist() == [2, 3, 4, 6, 7]
    rows = pool.rows(h)
    assert pool.req_to_token[rows[0], :3].tolist() == [2, 3, 4]
    assert pool.req_to_token[rows[1], :2].tolist() == [6, 7]


@pytest.mark.parametrize("counts", [[3, 2], 5, [0, 9]])
def test_failed_table_update_rolls_the_allocator_back(monkeypatch, counts):
    pool, twin = device_path_pool(), device_path_pool()
    h, ht = pool.open(3), twin.open(3)
    for p, hh in ((pool, h), (twin, ht)):
        p.extend(hh, [1, 4, 0])
        p.close(hh[2:])
    h, ht = h[:2], ht[:2]
    before = state(pool, h)

    def failing_update(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory (injected)")

    monkeypatch.setattr(pool_module, "update_req_to_token", failing_update)
    with pytest.raises(RuntimeError, match="injected"):
        pool.extend(h, counts)
    assert state(pool, h) == before
    pool.allocator.check()
    monkeypatch.undo()
    # The free stack is back in its old order: the retried call hands out the
    # same slots as a twin pool that never failed.
    assert pool.extend(h, counts).slots.tolist() == twin.extend(ht, counts).slots.tolist()
    assert torch.equal(pool.req_to_token, twin.req_to_token)


def test_failed_extend_of_a_prefix_hit_keeps_its_prompt(monkeypatch):
    """The roll-back gives back positions that are still the prompt's: a retried extend
    (without token ids, as after any open_with_prefix) must take the prompt's ids again,
    so that closing with cache=True registers the pages and the prompt hits later."""
    pool, twin = device_path_pool(), device_path_pool()
    prompt = [5, 6, 7, 8, 9, 10, 11]
    h, cached = pool.open_with_prefix(prompt, [7])
    ht, _ = twin.open_with_prefix(prompt, [7])
    assert cached.tolist() == [0]

    def failing_update(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory (injected)")

    monkeypatch.setattr(pool_module, "update_req_to_token", failing_update)
    with pytest.raises(RuntimeError, match="injected"):
        pool.extend(h, 7)
    monkeypatch.undo()
    for p, hh in ((pool, h), (twin, ht)):
        p.extend(hh, 7)
        assert p.known_tokens(int(hh[0])).tolist() == prompt
        p.close(hh, cache=True)
        assert p.open_with_prefix(prompt, [7])[1].tolist() == [6]
    pool.check()


def test_failed_copy_on_write_table_write_rolls_the_extend_back(monkeypatch):
    """The table entries a copy-on-write moved are written after the new slots': when
    that write fails, the extend is rolled back too, and the request's row names the
    slots the allocator says it holds (here: its private copy, which keeps the K/V)."""
    pool = kvpool.KVPool(1, 1, 4, num_pages=20, page_size=4, max_requests=4, max_context_len=16,
                         dtype=torch.float32)
    pool._table_np = None
    h, r = pool.admit([2])
    k = torch.arange(8, dtype=torch.float32).view(2, 1, 4)
    pool.write(0, r.slots, k, -k)
    parent = int(h[0])
    kid = int(pool.fork(parent, 1)[0])
    free = pool.free_pages
    import kvpool.sharing as sharing_module

    write = sharing_module.write_req_to_token
    failures = [RuntimeError("CUDA error: out of memory (injected)")]

    def fails_once(*args, **kwargs):  # a transient error: the roll-back's own writes succeed
        if failures:
            raise failures.pop()
        return write(*args, **kwargs)

    monkeypatch.setattr(sharing_module, "write_req_to_token", fails_once)
    with pytest.raises(RuntimeError, match="injected"):
        pool.extend(h, 1)  # into the shared, partly filled last page: a copy
    monkeypatch.undo()
    pool.check()
    assert pool.lengths([parent, kid]).tolist() == [2, 2] and pool.free_pages >= free - 1
    for x in (parent, kid):
        slots = pool.slots(x)
        assert pool.req_to_token[pool.rows([x])[0], :2].tolist() == slots.tolist()
        got_k, got_v = pool.read(0, slots)
        assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    res = pool.extend(h, 1)
    slots = pool.slots(parent)
    assert pool.req_to_token[pool.rows(h)[0], :3].tolist() == slots.tolist() and slots[2] == res.slots[0]


def test_meta_device_is_refused_before_anything_is_made():
    with pytest.raises(kvpool.InvalidArgumentError, match="'cpu' or 'cuda'"):
        kvpool.KVPool(1, 1, 4, num_pages=4, device="meta")


def _fail_table_writes(monkeypatch):
    import kvpool.sharing as sharing_module

    def failing_write(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory (injected)")

    monkeypatch.setattr(sharing_module, "write_req_to_token", failing_write)


def _counts(pool):
    stats = pool.stats()  # an undone open served no prompt: the hit rate does not count it
    return (pool.open_requests, pool.free_pages, pool.cached_pages, pool.evictable_pages, pool.used_pages,
            stats.hit_tokens, stats.miss_tokens, stats.host_hit_tokens)


def test_failed_fork_table_write_closes_the_new_requests(monkeypatch):
    pool = device_path_pool()
    h = pool.open(1)
    pool.extend(h, 5)
    before = _counts(pool)
    _fail_table_writes(monkeypatch)
    with pytest.raises(RuntimeError, match="injected"):
        pool.fork(int(h[0]), 2)
    assert _counts(pool) == before  # no half-made children holding the parent's pages
    pool.allocator.check()
    monkeypatch.undo()
    kids = pool.fork(int(h[0]), 2)
    for k in kids:
        assert pool.req_to_token[pool.rows(k)[0], :5].tolist() == pool.slots(int(h[0])).tolist()


def test_failed_prefix_table_write_closes_the_new_requests(monkeypatch):
    pool = device_path_pool()
    prompt = np.arange(8)
    h, _ = pool.admit([8], tokens=prompt)
    pool.close(h, cache=True)
    before = _counts(pool)
    _fail_table_writes(monkeypatch)
    with pytest.raises(RuntimeError, match="injected"):
        pool.open_with_prefix(prompt, [8])
    assert _counts(pool) == before  # the hit pages are back in the cache, nothing held
    pool.allocator.check()
    monkeypatch.undo()
    hs, cached = pool.open_with_prefix(prompt, [8])
    assert cached.tolist() == [6]  # the cache still serves the prefix (never the last token)
    assert pool.req_to_token[pool.rows(hs)[0], :6].tolist() == pool.slots(int(hs[0]))[:6].tolist()


def test_failed_chain_hash_open_closes_its_request_and_counts_no_hit(monkeypatch):
    """A transfer's receiver (``open_with_chain_hashes``) whose table write fails."""
    pool = device_path_pool()
    sender = kvpool.KVPool(1, 1, 4, num_pages=20, page_size=2, max_requests=4, max_context_len=16,
                           hash_seed=pool.hash_seed)
    prompt = np.arange(8)
    h, _ = pool.admit([8], tokens=prompt)
    pool.close(h, cache=True)
    hs, _ = sender.admit([8], tokens=prompt)
    chain = sender.chain_hashes(int(hs[0]))
    before = _counts(pool)
    _fail_table_writes(monkeypatch)
    with pytest.raises(RuntimeError, match="injected"):
        pool.open_with_chain_hashes(*chain)
    assert _counts(pool) == before
    pool.allocator.check()
    monkeypatch.undo()
    assert pool.length(pool.open_with_chain_hashes(*chain)) == 8
    assert _counts(pool)[5] == before[5] + 8  # the retried open counts its hit


def test_failed_swap_in_table_write_leaves_the_requests_swapped_out(monkeypatch):
    """swap_in's rows are rewritten after the core brought the pages back: if that write
    fails, the requests go back to the host (their K/V with them) rather than stay on the
    device behind rows that name the pages they had before swap_out."""
    pool = kvpool.KVPool(1, 1, 4, num_pages=20, page_size=2, max_requests=4, max_context_len=16, host_pages=12)
    pool._table_np = None
    h, r = pool.admit([5], tokens=np.arange(5))
    k = torch.arange(5, dtype=torch.float16).view(5, 1, 1).expand(5, 1, 4) + 1
    pool.write(0, r.slots, k, -k)
    pool.swap_out(h)
    other, _ = pool.admit([12])  # takes the pages h let go
    pool.write(0, pool.slots(int(other[0])), torch.zeros(12, 1, 4, dtype=torch.float16),
               torch.zeros(12, 1, 4, dtype=torch.float16))
    pool.close(other)
    before = _counts(pool)
    _fail_table_writes(monkeypatch)
    with pytest.raises(RuntimeError, match="injected"):
        pool.swap_in(h)
    assert pool.is_swapped(int(h[0])) and _counts(pool) == before
    a = pool.allocator
    assert (a.pending_offloads, a.pending_loads) == (0, 0)
    pool.allocator.check()
    monkeypatch.undo()
    pool.swap_in(h)
    slots = pool.slots(int(h[0]))
    assert pool.req_to_token[pool.rows(h)[0], :5].tolist() == slots.tolist()
    got_k, got_v = pool.read(0, slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, -k)


def _fail_once(monkeypatch, owner, name):
    """Make ``owner.name`` raise on its first call only (a roll-back's retry then succeeds)."""
    real, calls = getattr(owner, name), []

    def once(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory (injected)")
        return real(*a, **kw)

    monkeypatch.setattr(owner, name, once)
    return calls


@pytest.mark.parametrize("device_path", [False, True], ids=["cpu", "device"])
def test_failed_copy_on_write_copy_rolls_the_extend_back_on_either_path(monkeypatch, device_path):
    # The CPU path ran its copy outside any roll-back: the request stayed extended, and its
    # shared half page named a private copy that was never filled (K/V read back as zeros).
    import kvpool.sharing as sharing
    pool = kvpool.KVPool(1, 1, 4, num_pages=16, page_size=4, max_requests=4, max_context_len=32,
                         dtype=torch.float32)
    if device_path:
        pool._table_np = None
    h, r = pool.admit([6])
    k = torch.arange(24, dtype=torch.float32).view(6, 1, 4) + 1
    pool.write(0, r.slots, k, -k)
    pool.fork(int(h[0]), 1)
    free = pool.free_pages
    calls = _fail_once(monkeypatch, sharing, "copy_slots")
    with pytest.raises(RuntimeError, match="injected"):
        pool.extend(h, 1)
    assert len(calls) == 2  # the roll-back made the private copy it keeps
    pool.check()
    assert pool.length(int(h[0])) == 6 and pool.free_pages == free - 1
    got, _ = pool.read(0, pool.slots(int(h[0])))
    assert torch.equal(got, k)


def _host_tier_pool_with_two_cached_pages(device_path: bool) -> kvpool.KVPool:
    """Seven usable pages, two of them cached (write_back: evicting one offloads it)."""
    pool = kvpool.KVPool(1, 1, 4, num_pages=8, page_size=4, max_requests=4, max_context_len=32,
                         dtype=torch.float32, host_pages=10)
    if device_path:
        pool._table_np = None
    h, _ = pool.admit([8], tokens=np.arange(8))
    pool.close(h, cache=True)
    return pool


@pytest.mark.parametrize("device_path", [False, True], ids=["cpu", "device"])
def test_failed_offload_of_an_extends_evictions_rolls_it_back_on_either_path(monkeypatch, device_path):
    from kvpool.tiers.transfers import TransferRunner
    pool = _host_tier_pool_with_two_cached_pages(device_path)
    o, _ = pool.admit([9])
    before = (pool.length(int(o[0])), pool.free_pages, pool.used_pages, pool.open_requests)
    _fail_once(monkeypatch, TransferRunner, "run")
    with pytest.raises(RuntimeError, match="injected"):
        pool.extend(o, 12)  # needs a cached page evicted, whose offload fails
    pool.check()
    assert (pool.length(int(o[0])), pool.free_pages, pool.used_pages, pool.open_requests) == before
    pool.extend(o, 12)  # and the pool goes on


@pytest.mark.parametrize("device_path", [False, True], ids=["cpu", "device"])
def test_failed_offload_of_an_admits_evictions_closes_its_requests(monkeypatch, device_path):
    # The caller never got the handles: left open, they held every page until reset().
    from kvpool.tiers.transfers import TransferRunner
    pool = _host_tier_pool_with_two_cached_pages(device_path)
    _fail_once(monkeypatch, TransferRunner, "run")
    with pytest.raises(RuntimeError, match="injected"):
        pool.admit([28])  # seven pages: evicts both cached ones, whose offload fails
    pool.check()
    assert pool.open_requests == 0 and pool.used_pages == 0
    handles, _ = pool.admit([28])
    assert pool.length(int(handles[0])) == 28
