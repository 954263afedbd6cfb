"""Beam search on a pool with rows for the beams and no more. A reorder forked its extra
copies before it closed the rows it dropped, so its peak was nearly twice the beams: with
``pool_for_model``'s default ``max_requests=64``, batch 8 x 5 beams (40 rows) failed at the
first step that continued a beam twice. Now the dropped rows close first when the copies
need their rows; a fork failing after that leaves the cache refusing all but reset/close."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool

transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch
from _hf_models import greedy, left_padded, tiny_model  # noqa: E402
from test_hf_reorder_failure import open_rows  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvpool.integrations.transformers import KVPoolCache, pool_for_model  # noqa: E402


def test_beam_search_needs_no_rows_past_the_beams():
    model = tiny_model("llama")
    ids, mask = left_padded([6, 9], seed=1)
    ref = greedy(model, ids, mask, 12, DynamicCache(config=model.config), num_beams=3, early_stopping=False)
    pool = pool_for_model(model, max_tokens=1024, page_size=4, max_requests=6)  # 2 prompts x 3 beams
    with KVPoolCache(pool) as cache:
        out = greedy(model, ids, mask, 12, cache, num_beams=3, early_stopping=False)
    assert torch.equal(out.sequences, ref.sequences)
    assert pool.open_requests == 0 and pool.used_pages == 0
    pool.check()


def test_a_hybrid_beam_search_needs_no_rows_past_the_beams():
    from _hf_hybrid_models import tiny

    for arch in ("gemma3", "qwen3_next"):
        model = tiny(arch)
        ids, mask = left_padded([9, 5], seed=7)
        kw = dict(num_beams=2, early_stopping=False)
        ref = greedy(model, ids, mask, 10, DynamicCache(config=model.config), **kw)
        pool = pool_for_model(model, max_tokens=512, page_size=4, max_requests=4)  # 2 prompts x 2 beams
        with KVPoolCache(pool) as cache:
            out = greedy(model, ids, mask, 10, cache, **kw)
        assert torch.equal(out.sequences, ref.sequences), arch
        assert pool.open_requests == 0
        pool.check()


def _three_rows(max_requests):
    return open_rows(3, max_requests)


def test_the_dropped_rows_close_first_only_when_the_copies_need_them(monkeypatch):
    # A full pool: row 0 continues twice, row 2 is dropped; its row is the fork's.
    pool, br, k = _three_rows(3)
    forks_at = []
    real_fork = kvpool.KVPool.fork

    def fork(self, *a, **kw):
        forks_at.append(self.open_requests)
        return real_fork(self, *a, **kw)
    monkeypatch.setattr(kvpool.KVPool, "fork", fork)
    br.reorder([1, 0, 0])
    assert forks_at == [2] and pool.open_requests == 3
    br.begin_step(1)
    kk, vv = br.gather(0)
    assert torch.equal(kk[0, :, :6], k[1]) and torch.equal(kk[1, :, :6], k[0]) and torch.equal(vv[2, :, :6], -k[0])
    br.close()
    # With a row to spare the fork comes first, as before: a failed fork then changes nothing.
    pool, br, _ = _three_rows(4)
    forks_at.clear()
    br.reorder([1, 0, 0])
    assert forks_at == [3] and pool.open_requests == 3
    br.close()
    assert pool.open_requests == 0


def test_a_fork_failing_after_the_dropped_rows_closed_leaves_a_cache_that_refuses(monkeypatch):
    from kvpool.errors import IncompleteForwardError

    pool, br, _ = _three_rows(3)

    def boom(self, *a, **kw):
        raise RuntimeError("out of memory (injected)")
    monkeypatch.setattr(kvpool.KVPool, "fork", boom)
    with pytest.raises(RuntimeError, match="injected"):
        br.reorder([1, 0, 0])
    assert pool.open_requests == 2  # the dropped row is gone; no fork was left behind
    with pytest.raises(IncompleteForwardError, match="closed the rows it dropped"):
        br.check_broken("KVPoolCache.update")
    br.close()  # (the closed row is skipped)
    assert pool.open_requests == 0 and pool.used_pages == 0
    pool.check()
    assert np.asarray(pool.allocator.lengths(pool.open(1))).tolist() == [0]


def test_a_hybrid_fork_failing_after_the_dropped_rows_closed_leaves_a_cache_that_refuses(monkeypatch):
    from kvpool.errors import IncompleteForwardError

    pool = kvpool.KVPool(2, 2, 4, dtype=torch.float32, page_size=4, num_slots=256, max_requests=3, max_context_len=64,
                         layer_types=["full_attention", "sliding_attention"], sliding_window=4)
    cache = KVPoolCache(pool)
    for layer in range(2):
        k = torch.randn(3, 2, 5, 4)
        cache.update(k, -k, layer)

    def boom(*a, **kw):
        raise RuntimeError("out of memory (injected)")
    monkeypatch.setattr(pool, "fork", boom)
    with pytest.raises(RuntimeError, match="injected"):
        cache.reorder_cache(torch.tensor([0, 0, 1]))
    assert pool.open_requests == 2
    with pytest.raises(IncompleteForwardError, match="closed the rows it dropped"):
        cache.update(torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4), 0)
    with pytest.raises(IncompleteForwardError, match="closed the rows it dropped"):
        cache.crop(1)
    cache.close()
    assert pool.open_requests == 0
    pool.check()


def _boom(*a, **kw):
    raise RuntimeError("out of memory (injected)")


def test_a_broken_plain_cache_refuses_a_decode_step_inside_its_pages(monkeypatch):
    """The short way of update (a step inside pages the rows own, deferred: no pool call)
    took decode steps on the rows left after a reorder lost one (reviewer's find)."""
    from kvpool.errors import IncompleteForwardError

    pool = kvpool.KVPool(2, 2, 4, dtype=torch.float32, page_size=4, num_slots=256, max_requests=3, max_context_len=64)
    cache = KVPoolCache(pool)
    with torch.no_grad():
        for t in (5, 1):
            for layer in range(2):
                k = torch.randn(3, 2, t, 4)
                cache.update(k, -k, layer)
    with monkeypatch.context() as m:
        m.setattr(kvpool.KVPool, "fork", _boom)
        with pytest.raises(RuntimeError, match="injected"):
            cache.reorder_cache(torch.tensor([0, 0, 1]))
    with torch.no_grad(), pytest.raises(IncompleteForwardError, match="closed the rows it dropped"):
        k = torch.randn(3, 2, 1, 4)
        cache.update(k, -k, 0)
    cache.close()
    assert pool.open_requests == 0
    pool.check()


def test_a_broken_hybrid_cache_lets_no_state_layer_write_a_slot_it_lost(monkeypatch):
    """A linear-attention layer in front of the first attention layer wrote the rows' states
    through its view, the lost row's slot included, which another request held by then."""
    from kvpool.errors import IncompleteForwardError

    pool = kvpool.KVPool(2, 2, 4, dtype=torch.float32, page_size=4, num_slots=256, max_requests=3, max_context_len=64,
                         layer_types=["linear_attention", "full_attention"], state_shapes={"recurrent": (2, 4, 4)})
    cache = KVPoolCache(pool)
    state = cache.layers[0]
    with torch.no_grad():
        state.update_recurrent_state(torch.zeros(3, 2, 4, 4))
        k = torch.randn(3, 2, 5, 4)
        cache.update(k, -k, 1)
    with monkeypatch.context() as m:
        m.setattr(pool, "fork", _boom)
        with pytest.raises(RuntimeError, match="injected"):
            cache.reorder_cache(torch.tensor([0, 0, 1]))
    other = pool.open(1)
    slot = int(pool.state_slots(other, 0)[0])
    pool.state(0, "recurrent")[slot] = 42.0
    with torch.no_grad(), pytest.raises(IncompleteForwardError, match="closed the rows it dropped"):
        state.update_recurrent_state(torch.full((3, 2, 4, 4), 7.0))
    assert bool((pool.state(0, "recurrent")[slot] == 42.0).all())
    cache.close()
    pool.close(other)
    assert pool.open_requests == 0
    pool.check()
