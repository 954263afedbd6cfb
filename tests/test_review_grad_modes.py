"""Outside review of the grad-mode contract: objects kvpool builds under one grad mode and
used under another. Every persistent tensor (made at construction or lazily) must be a
normal, grad-free tensor, so that in-place updates work whatever mode a later call runs in."""

from __future__ import annotations

import contextlib

import pytest
import torch

import kvpool


@contextlib.contextmanager
def inference_inside_no_grad():
    with torch.no_grad(), torch.inference_mode():
        yield


BUILD_MODES = {"inference_mode": torch.inference_mode, "inference_inside_no_grad": inference_inside_no_grad}


@pytest.mark.parametrize("build", list(BUILD_MODES))
def test_a_linear_attention_cache_built_in_inference_mode_serves_generate_and_grad_mode(build):
    """transformers' ``LinearAttentionCacheLayerMixin.__init__`` makes a ``cumulative_length_linear``
    counter that the model bumps in place on every decode step (``increase_count``). Built
    under inference mode it was an inference tensor: ``generate`` (which runs under
    ``no_grad``) raised "Inplace update to inference tensor outside InferenceMode" on the
    first decode step of a Qwen3-Next cache made in a ``with torch.inference_mode():``."""
    from _hf_hybrid_models import P, tiny  # skips without transformers
    from _hf_models import CACHE_KW, greedy, left_padded

    from kvpool.integrations.transformers import KVPoolCache, pool_for_model

    model = tiny("qwen3_next")
    pool = pool_for_model(model, max_tokens=64, page_size=P, max_requests=2)
    with BUILD_MODES[build]():
        cache = KVPoolCache(pool)
    ids, mask = left_padded([5], seed=1)
    out = greedy(model, ids, mask, 3, cache)  # generate: no_grad
    assert out.sequences.shape == (1, 8)
    assert kvpool.audit(cache=cache, pool=pool) == []
    with torch.enable_grad():  # and one more step under grad mode
        nxt = out.sequences[:, -1:]
        logits = model(input_ids=nxt, attention_mask=torch.ones(1, 9, dtype=torch.long), **{CACHE_KW: cache}).logits
    assert logits.requires_grad
    # (the cache's working copies of the states carry this step's autograd history until the
    # next step writes them back detached; the pool's tensors never do)
    assert kvpool.audit(pool=pool) == []
    cache.close()
    pool.check()
