"""Pool results against expectations derived by hand, not from another call
of the same code path: slot ids of a fresh pool, CSR page tables, the device
page-table packing (run on CPU by standing in for the H2D copy), the decode
runner's output against a dense attention reference, and the runner's debug
address check."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kvpool
from kvpool import tables
from kvpool.cuda_graph import DecodeGraphRunner
from kvpool.testing.toy_step import ToyDecode


def fresh_slots(counts, page_size):
    """Slots a fresh pool hands out: pages 1, 2, 3, ... in request order."""
    out, page = [], 1
    for c in counts:
        for i in range(c):
            if i % page_size == 0:
                first = page * page_size
                page += 1
            out.append(first + i % page_size)
    return out


@pytest.mark.parametrize("page_size", [1, 4])
def test_fresh_pool_slots_and_out_cache_loc(page_size):
    pool = kvpool.KVPool(1, 1, 4, num_pages=32, page_size=page_size, max_requests=4, max_context_len=16)
    h = pool.open(3)
    res = pool.extend(h, [5, 1, 3])
    expect = fresh_slots([5, 1, 3], page_size)
    assert res.slots.tolist() == expect
    assert res.out_cache_loc.dtype == torch.int64 and res.out_cache_loc.tolist() == expect
    assert pool.req_to_token[int(h[0]) & 0xFFFFFFFF, :5].tolist() == expect[:5]


def test_page_table_matches_hand_built_csr():
    pool = kvpool.KVPool(1, 1, 4, num_pages=32, page_size=4, max_requests=4, max_context_len=16)
    h = pool.open(3)
    pool.extend(h, [5, 0, 8])  # pages: [1, 2], [], [3, 4]
    pt = pool.page_table(h)
    assert pt.kv_indptr.tolist() == [0, 2, 2, 4]
    assert pt.kv_indices.tolist() == [1, 2, 3, 4]
    assert pt.kv_last_page_len.tolist() == [1, 0, 4]
    assert all(t.dtype == torch.int32 for t in pt)


def test_device_page_table_split_checks_all_three_arrays():
    """The CUDA branch packs the three arrays into one copy and slices them
    back; run it on CPU by making the 'H2D copy' a host view."""
    copies = []

    def fake_ring(host):
        copies.append(host.copy())
        return torch.from_numpy(host)

    indptr = np.array([0, 2, 2, 5], dtype=np.int32)
    indices = np.array([7, 9, 1, 2, 3], dtype=np.int32)
    last = np.array([3, 0, 16], dtype=np.int32)
    pt = tables.page_table_tensors(indptr, indices, last, torch.device("cuda", 0), fake_ring)
    assert len(copies) == 1  # one transfer for all three
    assert pt.kv_indptr.tolist() == [0, 2, 2, 5]
    assert pt.kv_indices.tolist() == [7, 9, 1, 2, 3]
    assert pt.kv_last_page_len.tolist() == [3, 0, 16]
    assert all(t.dtype == torch.int32 for t in pt)


def make_pool(page_size=2):
    pool = kvpool.KVPool(2, 2, 8, dtype=torch.float32, num_pages=48, page_size=page_size,
                         max_requests=8, max_context_len=16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for bufs in (pool.k_buffers, pool.v_buffers):
            for t in bufs:
                t.copy_(torch.randn(t.shape, generator=gen))
    return pool


def dense_reference(pool, step, handles, ids, positions):
    """ToyDecode's maths per request from the allocator's slot lists (not req_to_token)."""
    x = step.emb[torch.as_tensor(ids)].float()
    caches = [(pool.k_buffers[i].reshape(-1, 2, 8).clone(), pool.v_buffers[i].reshape(-1, 2, 8).clone())
              for i in range(pool.num_layers)]
    slots = [pool.allocator.slots(h).tolist() for h in handles]  # includes the new token
    for layer in range(pool.num_layers):
        k, v = step.kv(x, torch.as_tensor(positions), layer)
        kc, vc = caches[layer]
        out = torch.zeros_like(x)
        for b, s in enumerate(slots):
            kc[s[-1]], vc[s[-1]] = k[b], v[b]
            keys, vals = kc[s], vc[s]  # [t, H, D]
            p = torch.softmax((keys * k[b]).sum(-1) / math.sqrt(8), dim=0)  # [t, H]
            out[b] = (p[..., None] * vals).sum(0).reshape(-1)
        x = x + out
    return x @ step.emb.float().T


@pytest.mark.parametrize("enable_graphs", [True, False])
def test_runner_output_matches_dense_reference(enable_graphs):
    pool = make_pool()
    h = pool.open(3)
    pool.extend(h, [2, 5, 1])
    res = pool.extend(h, 1)
    lens = pool.allocator.lengths(h)
    ids = np.array([3, 17, 60])
    step = ToyDecode(pool)
    expect = dense_reference(pool, step, h, ids, lens - 1)
    runner = DecodeGraphRunner(pool, step, 8, enable_graphs=enable_graphs)
    with torch.no_grad():
        got = runner.run(ids, lens - 1, pool.rows(h), res.slots, lens)
    assert got.shape == (3, 64)
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)


def test_runner_debug_address_check_on_cpu():
    pool = make_pool()
    runner = DecodeGraphRunner(pool, ToyDecode(pool), 4, debug=True)
    runner._ptrs = runner._addresses()  # what a capture records
    runner._check_addresses()  # nothing moved
    runner._static = runner._static.clone()
    with pytest.raises(kvpool.InvariantError, match="moved"):
        runner._check_addresses()
    runner._ptrs = runner._addresses()
    pool.req_to_token = pool.req_to_token.clone()
    with pytest.raises(kvpool.InvariantError, match="moved"):
        runner._check_addresses()
