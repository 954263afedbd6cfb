"""Tiny random-weight hybrid models for the HF tests: Gemma 3 and GPT-OSS (sliding and full
attention), Mistral (sliding_window) and Qwen3-Next (linear attention and full attention)."""

from __future__ import annotations

from typing import Any

import torch
from _hf_models import PAD, VOCAB, transformers

W, P = 8, 4  # window, page size
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
MODELS = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, sliding_window=W,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=16, sliding_window=W, num_local_experts=4, num_experts_per_tok=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=W)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        head_dim=16, linear_num_key_heads=2, linear_key_head_dim=8, linear_num_value_heads=4,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])),
}


def tiny(arch: str) -> Any:
    """`arch` (a MODELS key) with 4 layers, window W, float32, eval mode, built outside inference mode."""
    config_name, model_name, extra = MODELS[arch]
    kwargs = dict(BASE, **extra)
    with torch.inference_mode(False), torch.no_grad():
        torch.manual_seed(0)
        return getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs)).eval()
