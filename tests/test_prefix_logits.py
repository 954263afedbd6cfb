"""Prefix reuse, fork and copy-on-write give the logits of a full forward pass with no cache.

The shared-prefix demo engine serves requests that share system prompts (prefix
hits: only the suffix is prefilled, attending to cached K/V through the table row)
and fork into continuations (shared pages; the partly filled last page is copied
on write when a continuation first extends into it). Every logit row must match
``forward_full`` over the same tokens, at page sizes 1 and 16, in both layouts, in
a pool small enough that cached prefixes are evicted and recomputed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
from kvpool.demo.model import ModelConfig, build_model
from kvpool.demo.shared_prefix import PrefixEngine, shared_prefix_requests

CFG = ModelConfig(vocab_size=96, hidden=32, layers=2, heads=4, kv_heads=2, max_positions=96, seed=5)
ATOL, RTOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def model():
    return build_model(CFG)


def make_pool(page_size, pool_tokens, layout, max_requests=8):
    return kvpool.KVPool(CFG.layers, CFG.kv_heads, CFG.head_dim, dtype=torch.float32,
                         page_size=page_size, num_pages=-(-pool_tokens // page_size) + 1,
                         max_requests=max_requests, max_context_len=96, layout=layout)


def serve(model, pool, n=24, seed=2):
    reqs = shared_prefix_requests(n, vocab_size=CFG.vocab_size, system_prompts=3, system_len=(20, 40),
                                  user_len=(1, 12), output_len=(1, 10), fork_share=0.4, fork_n=(2, 3),
                                  seed=seed)
    engine = PrefixEngine(model, pool, max_running=6, record=True)
    with torch.inference_mode():
        engine.run(reqs)
    return reqs, engine


def check_logits(model, req):
    tokens = req.all_tokens()
    if len(tokens) == req.cached_len:  # a continuation whose only token came from its parent's prefill
        assert not req.logits
        return
    got = torch.cat(req.logits)  # computed positions only: cached_len .. len(tokens) - 1
    assert got.shape == (len(tokens) - req.cached_len, CFG.vocab_size), req.rid
    with torch.inference_mode():
        ref = model.forward_full(tokens)[req.cached_len :]
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"request {req.rid}: {m}")


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["token", "paged"])
def test_prefix_hits_forks_and_cow_match_full_forward_under_eviction(model, page_size, layout):
    # 224 tokens hold a few running requests and little cache: prefixes get evicted and recomputed.
    pool = make_pool(page_size, 224, layout)
    reqs, engine = serve(model, pool)
    every = [r for q in reqs for r in [q, *q.forks]]
    for r in every:
        assert len(r.output) == r.max_new_tokens
        check_logits(model, r)
    p = engine.prefix
    assert p.hit_tokens > 0, "no prefix hit: reuse untested"
    assert p.forks > 0
    kinds = pool.allocator.take_events()["kind"]
    assert int(np.count_nonzero(kinds == 1)) > 0, "nothing was evicted (no Removed event): pressure untested"
    # A request whose system prompt was evicted recomputed it: some prompt longer than a page missed.
    assert any(q.cached_len == 0 and len(q.prompt) > 2 * page_size for q in reqs)
    if page_size > 1:
        assert any(len(q.prompt) % page_size and q.forks for q in reqs), "no fork shared a partial page"
    assert pool.allocator.open_requests == 0
    assert pool.allocator.used_pages == 0  # nothing held; cached pages stay for later hits
    pool.allocator.check()
