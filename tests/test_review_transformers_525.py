"""KVPoolCache under the cache API transformers 5.25 changed (and 5.24, which pyproject allows).

5.25 let assisted decoding (assistant models, prompt lookup) run on linear-attention models:
the cache records the past (``activate_past_recording(recurrent_states_to_keep=...)``), the
model hands ``update_recurrent_state`` the states after each of the forward's last tokens, and
generate crops the rejected draft tokens away. A pool rolls a state back only to a checkpoint
that ``cache()`` took, so such a crop raised ``RollbackUnavailableError`` after the first
verification forward. The cache now says it is not croppable, and generate refuses with its
own ``ValueError`` after the prefill (5.24: the same ``ValueError`` kind, for stateful models).
Attention-only and sliding-window caches do crop: their assisted decoding matches DynamicCache,
except on rows opened on a prefix hit (any transformers 5.x: refused, it generated wrong tokens).
"""

from __future__ import annotations

import pytest
import torch
from _hf_hybrid_models import P, tiny
from _hf_models import greedy, left_padded, tiny_model

transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

# 5.25 sizes the recording (``recurrent_states_to_keep``); 5.24's activate_past_recording takes nothing.
KEEP = dict(recurrent_states_to_keep=4) if hasattr(Cache, "get_recurrent_states_to_keep") else {}

from kvpool.errors import InvalidArgumentError
from kvpool.integrations.transformers import KVPoolCache, pool_for_model


@pytest.mark.parametrize("kw", [dict(prompt_lookup_num_tokens=3), dict(assistant="perturbed")],
                         ids=["prompt-lookup", "assistant-model"])
def test_assisted_decoding_on_linear_attention_is_refused_by_generate(kw):
    model = tiny("qwen3_next")
    if "assistant" in kw:
        kw = dict(assistant_model=tiny("qwen3_next"))
        with torch.no_grad():  # an assistant that drafts tokens the model rejects (a crop of > 0 tokens)
            for p in kw["assistant_model"].parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5 * p.std())
    ids, mask = left_padded([10], seed=3)
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=8)
    with KVPoolCache(pool) as cache:
        with pytest.raises(ValueError, match="cropped|stateful"):
            greedy(model, ids, mask, 12, cache, **kw)
        assert not cache.is_croppable  # its state layers roll back only to the pool's checkpoints
        # Recording the past would only cost the model a per-token recurrence for nothing.
        assert not any(cache.is_recording_past(i) for i in range(len(cache.layers)))
    assert pool.open_requests == 0
    pool.check()


def test_past_recording_asked_of_a_linear_attention_cache_keeps_parity():
    """generate and the candidate generators call activate_past_recording on the cache they
    use; the state layers decline it, and greedy decoding still matches DynamicCache."""
    model = tiny("qwen3_next")
    ids, mask = left_padded([11, 6], seed=4)
    ref = greedy(model, ids, mask, 10, DynamicCache(config=model.config))
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=8)
    with KVPoolCache(pool) as cache:
        cache.activate_past_recording(**KEEP)
        assert not any(cache.is_recording_past(i) for i in range(len(cache.layers)))
        if KEEP:
            assert cache.get_recurrent_states_to_keep() == 0
        out = greedy(model, ids, mask, 10, cache)
        assert cache.get_seq_length() == ids.shape[1] + 9
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    pool.check()


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt_oss"])
def test_prompt_lookup_crops_match_dynamic_cache(arch):
    """Prompt lookup drafts up to 10 tokens and crops the rejected ones (5.25 computes the crop
    from the draft length): a full pool, and sliding groups holding the window plus a page."""
    model = tiny_model(arch) if arch == "llama" else tiny(arch)
    ids, mask = left_padded([10], seed=3)
    kw = dict(prompt_lookup_num_tokens=10)
    ref = greedy(model, ids, mask, 30, DynamicCache(config=model.config), **kw)
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=8)
    crops: list[int] = []
    with KVPoolCache(pool) as cache:
        crop = cache.crop
        cache.crop = lambda n: (crops.append(int(n)), crop(n))[1]
        out = greedy(model, ids, mask, 30, cache, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert min(crops) <= -2  # draft tokens were rejected and cropped away
    assert pool.open_requests == 0
    pool.check()


def test_assisted_decoding_on_rows_opened_on_a_prefix_hit_is_refused():
    """Assisted decoding's first forward takes the whole prompt, whatever the cache holds
    (DynamicCache gives wrong tokens as well when it starts non-empty). Rows opened on a
    cached prefix hold it already: the tokens were silently wrong; now refused up front."""
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (4,), generator=torch.Generator().manual_seed(0)).repeat(5)[None]
    kw = dict(prompt_lookup_num_tokens=8)
    ref = greedy(model, ids, None, 12, DynamicCache(config=model.config), **kw)
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=4)
    with KVPoolCache(pool, prefix_ids=ids) as cache:  # nothing cached yet: an empty start
        out = greedy(model, ids, None, 12, cache, **kw)
        assert cache.cached_lens.tolist() == [0]
    assert torch.equal(out.sequences, ref.sequences)
    with KVPoolCache(pool, prefix_ids=ids) as cache:
        assert cache.cached_lens.tolist() == [16]
        with pytest.raises(InvalidArgumentError, match="prefix"):
            greedy(model, ids, None, 12, cache, **kw)
        assert cache.get_seq_length() == 16  # refused before any forward
        out = greedy(model, ids, None, 12, cache)  # plain greedy on the hit is fine
    assert torch.equal(out.sequences, ref.sequences)
    assert pool.open_requests == 0
    pool.check()
