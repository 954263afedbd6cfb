"""Tiny random-weight transformers models and generate helpers for the HF tests."""

from __future__ import annotations

import inspect
from typing import Any

import torch

transformers = __import__("pytest").importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch
from transformers import (  # noqa: E402
    GenerationMixin,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB, PAD = 96, 0
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),       # q/k/v biases
    "mistral": (MistralConfig, MistralForCausalLM),
}
# Name of generate's cache argument: `cache` since 5.x renamed it, `past_key_values` before.
CACHE_KW = "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters \
    else "past_key_values"


def tiny_model(arch: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    """hidden 64, 2 layers, 4 heads / 2 KV heads, float32, eval mode, built outside inference mode."""
    config_cls, model_cls = ARCHS[arch]
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=PAD, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    with torch.inference_mode(False), torch.no_grad():
        torch.manual_seed(seed)
        model = model_cls(config_cls(**kwargs)).eval()
        if arch == "qwen2":
            # Random-init biases are zero; make them count.
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def left_padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded to the longest: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def greedy(model: Any, ids: torch.Tensor, mask: torch.Tensor | None, new_tokens: int, cache: Any = None,
           **extra: Any) -> Any:
    """Greedy generate that never stops early, with per-step logits."""
    kw: dict[str, Any] = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=PAD)
    if cache is not None:
        kw[CACHE_KW] = cache
    kw.update(extra)
    if mask is not None:
        kw["attention_mask"] = mask
    return model.generate(ids, **kw)
