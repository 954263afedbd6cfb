"""A forward under grad mode with a ``KVPoolCache`` (a script that forgot ``no_grad``, or
one that backpropagates through a scored continuation) gets the gradients it would get
with ``DynamicCache`` when the earlier tokens' K/V are held fixed: the step's own K/V
reach attention with their autograd history, the K/V of earlier forwards (stored in the
pool, which stays out of autograd) are constants."""

from __future__ import annotations

import pytest
import torch
from _hf_models import CACHE_KW, left_padded, tiny_model  # noqa: I001  (skips without transformers)
from transformers import DynamicCache

from kvpool.integrations.transformers import KVPoolCache, pool_for_model


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def detach_past(cache: DynamicCache) -> None:
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.detach(), layer.values.detach()


def gemma3() -> torch.nn.Module:
    """Sliding layers with a window shorter than the prompt: a hybrid pool."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=4, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention"])
    with torch.inference_mode(False), torch.no_grad():
        torch.manual_seed(0)
        return transformers.Gemma3ForCausalLM(config).eval()


@pytest.mark.parametrize(("arch", "page_size", "layer_buffers"),
                         [("llama", 1, True), ("llama", 16, True), ("llama", 16, False), ("gemma3", 4, True)])
def test_gradients_equal_the_default_caches_with_the_past_held_fixed(arch, page_size, layer_buffers):
    model = tiny_model("llama") if arch == "llama" else gemma3()
    model.requires_grad_(True)
    ids, mask = left_padded([7, 4, 9], seed=2)
    more = torch.randint(3, 90, (3, 2), generator=torch.Generator().manual_seed(1))
    m2 = torch.cat([mask, torch.ones_like(more)], 1)
    pool = pool_for_model(model, max_tokens=256, page_size=page_size, max_context_len=32)
    got = []
    with KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        for c in (DynamicCache(config=model.config), cache):
            per_step = []
            for x, m in ((ids, mask), (more, m2)):  # a prompt, then two more tokens on top
                model.zero_grad(set_to_none=True)
                logits = model(input_ids=x, attention_mask=m, **{CACHE_KW: c}).logits
                logits.square().mean().backward()
                per_step.append((logits.detach(), grads(model)))
                if not isinstance(c, KVPoolCache):
                    detach_past(c)
            got.append(per_step)
    for (ref_logits, ref_grads), (logits, g) in zip(*got):
        assert (ref_logits - logits).abs().max().item() <= 1e-4
        assert g.keys() == ref_grads.keys(), sorted(set(ref_grads) - set(g))
        for name in ref_grads:
            torch.testing.assert_close(g[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert not any(t.requires_grad for _, t in pool.named_tensors())
    pool.allocator.check()


@pytest.mark.parametrize("scattered", [False, True])
def test_a_linear_attention_state_under_grad_mode_stays_out_of_autograd(scattered):
    """Qwen3-Next under grad mode: the model copies its new conv / recurrent states into the
    cache in place, with their autograd history. The pool's state tensors must not take
    that history (they would require grad, chain every step's graph and fail audit); the
    logits still equal the default cache's."""
    import transformers

    import kvpool

    config = transformers.Qwen3NextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_num_value_heads=4, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"])
    with torch.inference_mode(False), torch.no_grad():
        torch.manual_seed(0)
        model = transformers.Qwen3NextForCausalLM(config).eval()
    ids, mask = left_padded([9, 6], seed=1)
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_requests=4)
    other = pool.open(3)
    if scattered:  # the batch's state slots are then not consecutive
        pool.close(other[1:2])
        other = other[[0, 2]]
    else:
        pool.close(other)
    logits = []
    with torch.enable_grad(), KVPoolCache(pool) as cache:
        for c in (DynamicCache(config=model.config), cache):
            m, out = mask, []
            for x in (ids, torch.tensor([[5], [6]]), torch.tensor([[7], [8]])):
                m = m if x is ids else torch.cat([m, torch.ones_like(x)], 1)
                out.append(model(input_ids=x, attention_mask=m, **{CACHE_KW: c}).logits)
                assert out[-1].requires_grad
            logits.append(out)
        assert [n for n, t in pool.named_tensors() if t.requires_grad] == []
        assert kvpool.audit(pool) == []
    for a, b in zip(*logits):
        assert (a - b).abs().max().item() <= 1e-5
    if scattered:
        pool.close(other)
    pool.check()
