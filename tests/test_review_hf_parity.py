"""Outside-check review of the transformers integration: greedy parity with DynamicCache on
architectures the other HF tests do not build, or a typed refusal up front (never wrong tokens)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _hf_hybrid_models import P, tiny
from _hf_models import CACHE_KW, PAD, greedy, left_padded

transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch
from transformers import DynamicCache  # noqa: E402

from kvpool.errors import IncompleteForwardError, InvalidArgumentError  # noqa: E402
from kvpool.integrations.transformers import KVPoolCache, pool_for_model  # noqa: E402

BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)


def build(model_name: str, config_name: str, **kw: Any) -> Any:
    with torch.inference_mode(False), torch.no_grad():
        torch.manual_seed(0)
        return getattr(transformers, model_name)(getattr(transformers, config_name)(**dict(BASE, **kw))).eval()


# Falcon's new decoder broadcast its K/V to every query head in _split_heads (gone in 5.25).
FALCON_EXPANDS = hasattr(transformers.models.falcon.modeling_falcon.FalconAttention, "_split_heads")
JAMBA_STATES = {"conv": (128, 4), "recurrent": (128, 8)}  # (expand * hidden, d_conv), (expand * hidden, d_state)


def free_pages(pool: Any) -> Any:
    """Free pages (per group on a hybrid pool)."""
    a = pool.allocator
    return [a.free_pages(g) for g in range(len(pool.groups))] if callable(a.free_pages) else a.free_pages


def assert_parity(model: Any, lengths: list[int], new: int = 10, page_size: int = 4, **pool_kwargs: Any) -> Any:
    ids, mask = left_padded(lengths, seed=1)
    ref = greedy(model, ids, mask, new, DynamicCache(config=model.config))
    pool = pool_for_model(model, max_tokens=256, page_size=page_size, max_requests=8, **pool_kwargs)
    free = free_pages(pool)
    with KVPoolCache(pool) as cache:
        out = greedy(model, ids, mask, new, cache)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    pool.check()
    assert pool.open_requests == 0 and free_pages(pool) == free
    return pool


@pytest.mark.parametrize("falcon, kv_heads", [
    (dict(), 1),  # Falcon-7B: multi_query=True, the old decoder: one K/V head for every query head
    (dict(multi_query=False), 4),  # one K/V head per query head
    # Falcon-40B: K/V cached expanded to every head up to transformers 5.24, its 2 K/V heads since 5.25
    (dict(new_decoder_architecture=True, num_kv_heads=2), 4 if FALCON_EXPANDS else 2),
], ids=["multi-query", "multi-head", "new-decoder"])
def test_falcon_pool_has_the_kv_heads_the_model_caches(falcon, kv_heads):
    """FalconConfig names its K/V heads ``num_kv_heads`` (no ``num_key_value_heads``), and the
    model caches 1 head under ``multi_query`` and every head with ``new_decoder_architecture``."""
    model = build("FalconForCausalLM", "FalconConfig", **falcon)
    pool = assert_parity(model, [7, 3, 5])
    assert pool.num_kv_heads == kv_heads


@pytest.mark.parametrize("config_name", ["DeepseekV3Config", "DeepseekV2Config"])
def test_multi_head_latent_attention_is_refused_by_pool_for_model(config_name):
    """MLA models cache a latent (width kv_lora_rank) as "keys" and the rotary part as
    "values", one head each: K and V of different widths, which no KVPool holds. Refused
    up front, not at the first forward with a hint to use pool_for_model."""
    config = getattr(transformers, config_name)(**dict(
        BASE, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=1, topk_group=1))
    with pytest.raises(InvalidArgumentError, match="kv_lora_rank"):
        pool_for_model(config, max_tokens=64, page_size=4)


def test_mamba_layers_updated_in_place_at_decode_match_dynamic_cache():
    """Jamba's Mamba layers update both states in place during decode (causal_conv1d_update,
    selective_state_update) without calling update_conv_state / update_recurrent_state. The
    cache took that for a forward its state layer had missed, and refused the next forward
    as if one had been cut short. docs/transformers.md: other Mamba layers pass state_shapes=."""
    model = build("JambaForCausalLM", "JambaConfig", intermediate_size=128, num_key_value_heads=2,
                  attn_layer_offset=1, attn_layer_period=2, expert_layer_period=2, num_experts=2,
                  mamba_d_state=8, mamba_dt_rank=8, mamba_expand=2, mamba_d_conv=4, tie_word_embeddings=False)
    pool = assert_parity(model, [7, 3, 5], state_shapes=JAMBA_STATES)
    assert {g.kind for g in pool.groups} == {"state", "full"}
    # A prefix hit resumes the Mamba state from the checkpoint at 16 (prefill reads it, then writes).
    g = torch.Generator().manual_seed(13)
    shared = torch.randint(3, 96, (16,), generator=g)
    for n, want in ((0, 0), (6, 16)):
        ids = torch.cat([shared, torch.randint(3, 96, (n,), generator=g)])[None]
        ref = greedy(model, ids, None, 8, DynamicCache(config=model.config))
        with KVPoolCache(pool, prefix_ids=ids) as cache:
            out = greedy(model, ids, None, 8, cache)
            assert cache.cached_lens.tolist() == [want]
        assert torch.equal(out.sequences, ref.sequences)
    pool.check()


def test_a_decode_cut_between_the_in_place_conv_update_and_the_recurrent_write_is_refused():
    """Qwen3-Next's decode updates the conv state in place (causal_conv1d_update) and only then
    writes the recurrent state. A forward cut in between moved the conv state a step; the
    retry must be refused (IncompleteForwardError, the state unchanged), not run on it."""
    model = tiny("qwen3_next")
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(5))
    pool = pool_for_model(model, max_tokens=128, page_size=P, max_requests=4)
    with torch.no_grad(), KVPoolCache(pool) as cache:
        model(input_ids=ids, **{CACHE_KW: cache})
        real = cache.update_recurrent_state

        def cut(states: Any, layer_idx: int, *a: Any, **kw: Any) -> Any:
            raise KeyboardInterrupt

        cache.update_recurrent_state = cut
        with pytest.raises(KeyboardInterrupt):
            model(input_ids=torch.tensor([[7]]), **{CACHE_KW: cache})
        cache.update_recurrent_state = real
        slots = pool.state_slots(cache.handles, 0)
        conv = pool.state(0, "conv")[slots].clone()
        with pytest.raises(IncompleteForwardError, match="cut short"):
            model(input_ids=torch.tensor([[7]]), **{CACHE_KW: cache})
        assert torch.equal(pool.state(0, "conv")[slots], conv)
    pool.check()
    assert pool.open_requests == 0


def test_kv_sharing_layers_are_refused_with_a_reason():
    """Gemma 3n's last layers reuse an earlier layer's K/V (transformers types them "dummy"
    and never calls the cache for them); pool_for_model says so rather than that "dummy" is
    not a layer type."""
    config = transformers.Gemma3nTextConfig(**dict(
        BASE, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, sliding_window=6, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2, intermediate_size=[128] * 4,
        activation_sparsity_pattern=[0.0] * 4, hidden_size_per_layer_input=16, vocab_size_per_layer_input=128))
    with pytest.raises(InvalidArgumentError, match=r"layers \[2, 3\] share"):
        pool_for_model(config, max_tokens=64, page_size=4)


def test_layers_without_attention_are_refused_with_their_reason():
    """Nemotron-H's "moe" / "mlp" layers have no attention (transformers types them "dummy" too);
    the refusal says that, not that they share another layer's K/V."""
    config = transformers.NemotronHConfig(
        vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["linear_attention", "moe", "full_attention", "mlp"])
    with pytest.raises(InvalidArgumentError, match=r"layers \[1, 3\] have no attention") as err:
        pool_for_model(config, max_tokens=64, page_size=4)
    assert "share" not in str(err.value)



GEMMA4 = dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, sliding_window=6,
              layer_types=["sliding_attention", "full_attention"] * 2)
needs_gemma4 = pytest.mark.skipif(not hasattr(transformers, "Gemma4TextConfig"),
                                  reason="this transformers has no Gemma 4 (5.x releases before it)")


@needs_gemma4
def test_layers_of_different_head_sizes_are_refused_typed():
    """Gemma 4's full-attention layers have their own head_dim (global_head_dim, 512 by default):
    its config refuses a global read of head_dim with transformers' own RuntimeError, which
    pool_for_model let through untyped. A pool has one head size: a typed refusal naming it."""
    config = transformers.Gemma4TextConfig(**dict(BASE, **GEMMA4))
    with pytest.raises(InvalidArgumentError, match=r"differ in head_dim \(\[16, 512, 16, 512\]"):
        pool_for_model(config, max_tokens=64, page_size=4)


@needs_gemma4
def test_gemma4_with_one_head_size_matches_dynamic_cache():
    """With global_head_dim equal to head_dim every layer reads the same, and the hybrid pool
    (sliding + full groups) gives DynamicCache's tokens and logits."""
    model = build("Gemma4ForCausalLM", "Gemma4TextConfig", **GEMMA4, global_head_dim=16)
    pool = assert_parity(model, [9, 4, 7], new=12)
    assert [g.layer_type for g in pool.groups] == ["sliding_attention", "full_attention"]
