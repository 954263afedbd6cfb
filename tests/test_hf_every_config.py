"""``pool_for_model`` on the default config of every causal LM the installed transformers
knows: a pool, or a typed ``KVPoolError`` that says why, never another library's exception.

transformers adds architectures every release (heterogeneous per-layer configs, new layer
types, K/V shared between layers); an outside check that loads one should hear what kvpool
cannot hold, not get a ``RuntimeError`` from a config read (Gemma 4's ``head_dim`` did that).
"""

from __future__ import annotations

import warnings

import pytest

transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from kvpool.errors import KVPoolError  # noqa: E402
from kvpool.integrations.transformers import pool_for_model  # noqa: E402


def test_every_causal_lm_config_gets_a_pool_or_a_typed_refusal():
    built, refused, untyped = [], {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (default configs warn about their own token ids)
        for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            try:
                config = CONFIG_MAPPING[model_type]()
            except Exception:  # noqa: BLE001  (a default transformers cannot build itself: not ours to check)
                continue
            try:
                pool_for_model(config, max_tokens=64, page_size=16, max_context_len=128, max_requests=2)
                built.append(model_type)
            except KVPoolError as e:
                refused[model_type] = str(e)
            except Exception as e:  # noqa: BLE001
                untyped[model_type] = f"{type(e).__name__}: {e}"
    assert not untyped, "pool_for_model raised another library's exception for:\n" + "\n".join(
        f"  {k}: {v[:300]}" for k, v in untyped.items())
    # Not vacuous: the common architectures build, and the ones kvpool cannot hold say why.
    assert len(built) > 100, built
    assert {"llama", "qwen2", "qwen3", "mistral", "gemma3_text", "gpt_oss", "qwen3_next"} <= set(built), built
    assert "multi-head latent attention" in refused["deepseek_v3"]
    if "llama4_text" in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:  # (transformers with Llama 4: its chunked layers)
        assert "'chunked_attention': layers [0, 1, 2, 4" in refused["llama4_text"]
        assert "DynamicCache" in refused["llama4_text"]
