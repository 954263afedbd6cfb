"""A reorder that fails half-way (the second fork finds too few free rows) gives back
the forks already made: the batch keeps its requests, the pool its rows and pages,
and the cache goes on working. Checked on ``BatchRequests`` (no transformers) and
through ``KVPoolCache.reorder_cache`` with a tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
from kvpool.integrations._requests import BatchRequests


def snapshot(pool) -> tuple:
    pool.check()
    return (pool.open_requests, pool.used_pages, pool.free_pages, pool.used_slots)


def open_rows(rows: int, max_requests: int):
    """A one-layer pool and a ``BatchRequests`` of ``rows`` rows holding 6 tokens each: the pool,
    the batch and the K written (V is -K)."""
    pool = kvpool.KVPool(1, 2, 4, dtype=torch.float32, page_size=4, num_pages=32, max_requests=max_requests,
                         max_context_len=64)
    br = BatchRequests(pool)
    br.ensure_open(rows)
    br.begin_step(6)
    k = torch.arange(rows * 6 * 2 * 4, dtype=torch.float32).view(rows, 2, 6, 4)
    br.write(0, k, -k)
    return pool, br, k


def test_batch_requests_reorder_gives_back_its_forks():
    # 2 rows open; the first row's two copies take 2 more rows; the second row's two
    # copies need 2 of the 1 left.
    pool, br, k = open_rows(2, max_requests=5)
    handles, before = br.handles.copy(), snapshot(pool)
    with pytest.raises(kvpool.TooManyRequestsError):
        br.reorder([0, 0, 0, 1, 1, 1])
    assert snapshot(pool) == before, "the forks made before the failure leaked"
    assert br.handles.tolist() == handles.tolist() and br.length == 6
    # Still usable: a reorder that fits, then a step.
    br.reorder([1, 0, 0])
    assert pool.open_requests == 3
    br.begin_step(1)
    kk, vv = br.gather(0)
    assert torch.equal(kk[1, :, :6], k[0]) and torch.equal(kk[0, :, :6], k[1]) and torch.equal(vv[2, :, :6], -k[0])
    br.close()
    assert snapshot(pool)[:2] == (0, 0)


def test_kvpool_cache_reorder_failure_leaves_the_cache_usable():
    from _hf_models import CACHE_KW, left_padded, tiny_model  # skips without transformers
    from transformers import DynamicCache

    from kvpool.integrations.transformers import KVPoolCache

    model = tiny_model("llama")
    cfg = model.config
    pool = kvpool.KVPool(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.float32,
                         page_size=4, num_pages=64, max_requests=5, max_context_len=64)
    ids, mask = left_padded([5, 8], seed=3)
    dyn = DynamicCache(config=cfg)
    with torch.no_grad(), KVPoolCache(pool) as cache:
        for c in (dyn, cache):
            model(input_ids=ids, attention_mask=mask, **{CACHE_KW: c})
        handles, before = np.asarray(cache.handles).copy(), snapshot(pool)
        with pytest.raises(kvpool.TooManyRequestsError):
            cache.reorder_cache(torch.tensor([0, 0, 0, 1, 1, 1]))
        assert snapshot(pool) == before, "the forks made before the failure leaked"
        assert np.asarray(cache.handles).tolist() == handles.tolist()
        assert cache.get_seq_length() == ids.shape[1]
        nxt = torch.tensor([[5], [6]])
        m2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        want = model(input_ids=nxt, attention_mask=m2, **{CACHE_KW: dyn}).logits
        got = model(input_ids=nxt, attention_mask=m2, **{CACHE_KW: cache}).logits
        assert (got - want).abs().max().item() <= 1e-4
    assert snapshot(pool)[:2] == (0, 0)


def test_a_reorder_whose_close_of_dropped_rows_fails_gives_back_its_forks(monkeypatch):
    # The forks were made, then closing the rows nobody continues failed (a host tier's copy,
    # say) outside the clean-up: a fork no row owned stayed open past reset().
    pool = kvpool.KVPool(1, 1, 4, dtype=torch.float32, page_size=2, num_pages=30, max_requests=10,
                         max_context_len=16)
    br = BatchRequests(pool)
    br.ensure_open(3)
    br.begin_step(3)
    handles, before = br.handles.copy(), snapshot(pool)
    real, calls = kvpool.KVPool.close, []

    def once(self, *a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory (injected)")
        return real(self, *a, **kw)
    monkeypatch.setattr(kvpool.KVPool, "close", once)
    with pytest.raises(RuntimeError, match="injected"):
        br.reorder([2, 2, 0])  # row 2 forked once, row 1 dropped
    assert snapshot(pool) == before and br.handles.tolist() == handles.tolist()
    br.reorder([2, 2, 0])
    assert pool.open_requests == 3
    br.close()
    assert pool.open_requests == 0
