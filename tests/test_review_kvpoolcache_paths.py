"""Outside checks of ``KVPoolCache``'s fast paths (issue 32's short ``update``, layer buffers,
deferred decode steps, views kept across steps), driven through the public API only and
compared with transformers' ``DynamicCache`` (or a full forward over the token history).

Bounded: a 2-3 layer, hidden-64 Llama (float32, CPU, one intra-op thread), at most a few
dozen steps per case."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from _hf_models import CACHE_KW, PAD, left_padded, tiny_model  # noqa: I001  (skips without transformers)
from transformers import DynamicCache

from kvpool import IncompleteForwardError
from kvpool.integrations.transformers import KVPoolCache, pool_for_model

TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_model("llama", num_hidden_layers=3)
    torch.set_num_threads(threads)


def forward(model, cache, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, **{CACHE_KW: cache}).logits


def decode_against_dynamic(model, cache, prompt, steps, between=None):
    """Greedy steps on ``cache`` and on a DynamicCache fed the same tokens; ``between(s)`` runs
    after step s. Returns the largest logit difference."""
    dyn = DynamicCache(config=model.config)
    x, worst = prompt, 0.0
    for s in range(steps):
        got, want = forward(model, cache, x), forward(model, dyn, x)
        worst = max(worst, (got - want).abs().max().item())
        x = want[:, -1].argmax(-1, keepdim=True)
        if between is not None:
            between(s)
    return worst


def pool_rows(pool, handles, layer, n):
    """Rows' first ``n`` tokens of ``layer`` read through the pool, as ``[B, H, n, D]``."""
    rows = pool.rows(np.asarray(handles))
    out = []
    for r in rows:
        idx = torch.as_tensor(np.asarray(pool.req_to_token[int(r), :n]).astype(np.int64))
        k, v = pool.read(layer, idx)
        out.append((k.transpose(0, 1), v.transpose(0, 1)))
    return torch.stack([k for k, _ in out]), torch.stack([v for _, v in out])


# -- the rows' pages changed by the pool's own calls on the cache's handles ------------------

@pytest.mark.parametrize("layer_buffers", [True, False])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_row_forked_through_the_pool_keeps_reading_its_own_pages(model, batch, layer_buffers):
    """``pool.fork(cache.handles[i])`` shares the row's pages; the row's next extend into its
    shared, partly filled last page copies it on write, so the row's K/V move to a new page.
    The cache must read them there (it kept its own page table while its rows shared none)."""
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_context_len=64)
    prompt = torch.randint(3, 90, (batch, 6), generator=torch.Generator().manual_seed(0))
    forks = []
    with KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        def between(s):
            if s == 3:
                forks.append(pool.fork(int(cache.handles[0]), 1))
            if s == 10:  # the fork extends after the row did: the row made the copy
                pool.extend(forks[0], 3)
        assert decode_against_dynamic(model, cache, prompt, 24, between) <= TOL
        pool.allocator.check()
    pool.close(forks[0])
    assert pool.allocator.used_pages == 0
    pool.allocator.check()


@pytest.mark.parametrize("layer_buffers", [True, False])
@pytest.mark.parametrize("page_size", [1, 4])
def test_rows_swapped_out_and_back_in_read_what_they_held(model, page_size, layer_buffers):
    """``swap_out`` / ``swap_in`` of the cache's rows (the pool says every position then reads
    the K/V it held): the pages they come back on differ, as another request took the old ones."""
    pool = pool_for_model(model, max_tokens=256, page_size=page_size, max_context_len=64, host_pages=64)
    other = pool.open(1)
    prompt = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(1))
    with KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        def between(s):
            if s == 3:
                h = cache.handles
                pool.swap_out(h)
                pool.extend(other, 5 * page_size)  # takes the freed device pages
                pool.swap_in(h)
        assert decode_against_dynamic(model, cache, prompt, 24, between) <= TOL
    pool.close(other)
    assert pool.allocator.used_pages == 0
    pool.allocator.check()
