"""generate features an engine author or a transformers user reaches for, on a plain model and on
the hybrids (sliding window, linear attention), at page sizes 1 and 16; the oracle is
``DynamicCache``'s tokens (greedy or seeded), same model and inputs.

Not repeated here (tested elsewhere): plain beam search and num_return_sequences
(test_review_kvpoolcache_paths), prompt lookup crops (test_review_transformers_525), assistant
models (test_review_hf_generate), continuing a cache across generate calls (test_hf_cache).
"""

from __future__ import annotations

import pytest
import torch
from _hf_hybrid_models import tiny  # noqa: I001  (skips without transformers)
from _hf_models import CACHE_KW, PAD, left_padded, tiny_model
from transformers import DynamicCache

from kvpool.integrations.transformers import KVPoolCache, pool_for_model

ARCHS = ["llama", "gemma3", "qwen3_next"]  # full attention; sliding (window 8); linear attention
_MODELS: dict[str, object] = {}


def model_for(arch: str):
    if arch not in _MODELS:
        _MODELS[arch] = tiny_model("llama") if arch == "llama" else tiny(arch)
    return _MODELS[arch]


def generate(model, ids, mask, cache, new_tokens, **kw):
    kw = dict(max_new_tokens=new_tokens, pad_token_id=PAD, do_sample=False, **kw)
    if "eos_token_id" not in kw:
        kw["min_new_tokens"] = new_tokens
    return model.generate(ids, attention_mask=mask, **{CACHE_KW: cache}, **kw)


def finish(pool) -> None:
    assert pool.open_requests == 0
    pool.check()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_gives_dynamic_caches_tokens(arch, page_size):
    """``prefill_chunk_size``: generate feeds the prompt in chunks of 5, one forward each, every
    chunk past the first on a non-empty cache (and past gemma3's window of 8)."""
    model = model_for(arch)
    ids, mask = left_padded([13, 9, 6], seed=5)
    ref = generate(model, ids, mask, DynamicCache(config=model.config), 8, prefill_chunk_size=5)
    pool = pool_for_model(model, max_tokens=1024, page_size=page_size, max_requests=8)
    with KVPoolCache(pool) as cache:
        out = generate(model, ids, mask, cache, 8, prefill_chunk_size=5)
        assert cache.get_seq_length() == ids.shape[1] + 7
    assert torch.equal(out, ref)
    finish(pool)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_manual_decode_loop_with_chunked_prompt_gives_dynamic_caches_logits(arch, page_size):
    """The loop people write: ``model(..., past_key_values=cache, use_cache=True)`` with the
    prompt in chunks of 3 (left-padded rows), then greedy steps from ``out.past_key_values``."""
    model = model_for(arch)
    ids, mask = left_padded([11, 7, 4], seed=6)

    def loop(cache):
        logits = []
        with torch.inference_mode():
            for s in range(0, ids.shape[1], 3):
                out = model(input_ids=ids[:, s:s + 3], attention_mask=mask[:, :s + 3], past_key_values=cache,
                            use_cache=True)
                logits.append(out.logits[:, -1].clone())
            m = mask
            for _ in range(6):
                cache = out.past_key_values
                x = out.logits[:, -1].argmax(-1, keepdim=True)
                m = torch.cat([m, torch.ones_like(x)], 1)
                out = model(input_ids=x, attention_mask=m, past_key_values=cache, use_cache=True)
                logits.append(out.logits[:, -1].clone())
        return torch.stack(logits), cache

    ref, _ = loop(DynamicCache(config=model.config))
    pool = pool_for_model(model, max_tokens=1024, page_size=page_size, max_requests=8)
    with KVPoolCache(pool) as cache:
        got, returned = loop(cache)
        assert returned is cache
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
    finish(pool)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_beams_that_finish_early_give_dynamic_caches_sequences_and_scores(arch, page_size):
    """Beam search where beams meet an eos at different steps (so generate keeps reordering
    through finished hypotheses), three returned per row, with their scores."""
    model = model_for(arch)
    ids, mask = left_padded([7, 12, 3], seed=11)
    # eos: the tokens beams pick most often in their first steps, so that some beams meet one
    first = generate(model, ids, mask, DynamicCache(config=model.config), 6, num_beams=3, num_return_sequences=3)
    eos = torch.bincount(first[:, ids.shape[1]:].flatten()).topk(4).indices.tolist()
    kw = dict(num_beams=3, num_return_sequences=3, eos_token_id=eos, early_stopping=False,
              return_dict_in_generate=True, output_scores=True)
    ref = generate(model, ids, mask, DynamicCache(config=model.config), 16, **kw)
    pool = pool_for_model(model, max_tokens=2048, page_size=page_size, max_requests=16)
    with KVPoolCache(pool) as cache:
        out = generate(model, ids, mask, cache, 16, **kw)
    assert torch.isin(ref.sequences[:, ids.shape[1]:-1], torch.tensor(eos)).any()  # some beam finished early
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=0, atol=1e-4)
    finish(pool)


MODES = {"inference": torch.inference_mode, "no_grad": torch.no_grad}


@pytest.mark.parametrize("first", ["inference", "no_grad"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_cache_made_under_one_grad_mode_goes_on_under_the_other(arch, first):
    """A cache made and filled under ``inference_mode`` continued under ``no_grad``, and the
    reverse. The oracle runs both generates under ``no_grad``: ``DynamicCache`` itself cannot
    continue a linear-attention cache made under ``inference_mode`` (its in-place state
    counter is an inference tensor)."""
    model = model_for(arch)
    second = "no_grad" if first == "inference" else "inference"
    ids, mask = left_padded([7, 12, 3], seed=4)

    def run(cache, modes):
        with MODES[modes[0]]():
            out = generate(model, ids, mask, cache, 6)
        mask2 = torch.cat([mask, torch.ones(3, 6, dtype=mask.dtype)], 1)
        with MODES[modes[1]]():
            return out, generate(model, out, mask2, cache, 6)

    ref = run(DynamicCache(config=model.config), ("no_grad", "no_grad"))
    pool = pool_for_model(model, max_tokens=1024, page_size=16, max_requests=8)
    with KVPoolCache(pool) as cache:
        got = run(cache, (first, second))
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    finish(pool)
