"""Outside-style checks of ``HybridKVPoolCache`` on linear-attention models (tiny random Qwen3-Next,
bfloat16, CPU): parity with transformers' ``DynamicCache``. Bounded: 4-layer, hidden-64 models."""

from __future__ import annotations

import torch
from _hf_hybrid_models import P, tiny  # noqa: I001  (skips without transformers)
from _hf_models import greedy, left_padded
from transformers import DynamicCache

from kvpool.integrations.transformers import KVPoolCache, pool_for_model


def test_a_bf16_linear_attention_model_keeps_a_float32_recurrent_state_and_dynamic_caches_tokens():
    """transformers' gated delta rule returns the recurrent state in float32 and DynamicCache keeps
    it so; pool_for_model gave it the model's bf16, which rounded it at every step: logits drifted
    from the first decode step and a batch's tokens differed within 16."""
    model = tiny("qwen3_next").to(torch.bfloat16)
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=4)
    assert pool.state_shapes["recurrent"] == ((4, 8, 8), torch.float32)
    assert pool.state_shapes["conv"] == ((64, 4), torch.bfloat16)  # (DynamicCache's conv state is the model's)
    ids, mask = left_padded([12, 5, 9], seed=3)
    ref = greedy(model, ids, mask, 16, DynamicCache(config=model.config))
    with KVPoolCache(pool) as cache:
        out = greedy(model, ids, mask, 16, cache)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        assert torch.equal(a, b)
    pool.check()
