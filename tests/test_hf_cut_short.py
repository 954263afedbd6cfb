"""A forward that stops part-way (an exception raised in a middle layer: out of memory, an
interrupt, a hook) leaves some layers of a ``KVPoolCache`` with the step stored and the
others without. The cache then says so with ``IncompleteForwardError`` (typed, nothing
changed) to anything that would build on the half-stored step, and ``crop`` drops the
unfinished step: the cache goes on as if that forward had never run, as a ``DynamicCache``
that never saw it does."""

from __future__ import annotations

import pytest
import torch
from _hf_models import CACHE_KW, left_padded, tiny_model  # noqa: I001  (skips without transformers)
from transformers import DynamicCache

from kvpool import IncompleteForwardError, KVPoolError
from kvpool.integrations.transformers import KVPoolCache, pool_for_model

TOL = 1e-4


class Cut(Exception):
    pass


def cut_at(model, layer: int):
    """A pre-hook that raises before ``layer`` runs (remove it with ``.remove()``)."""
    def boom(module, args, kwargs):
        raise Cut(f"stopped before layer {layer}")
    return model.model.layers[layer].register_forward_pre_hook(boom, with_kwargs=True)


def state(pool, cache) -> tuple:
    pool.allocator.check()
    a = pool.allocator
    return (a.open_requests, a.used_pages, a.free_pages, pool.allocator.lengths(cache.handles).tolist(),
            [layer.seen for layer in cache._pool_layers], cache.get_seq_length())


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_hidden_layers=3)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("fed", [1, 3], ids=["decode", "chunk"])
def test_crop_drops_a_forward_cut_short_and_the_cache_goes_on(model, batch, page_size, fed):
    ids, mask = left_padded([9, 5, 12][:batch], seed=batch)
    pool = pool_for_model(model, max_tokens=512, page_size=page_size, max_context_len=64)
    more = torch.randint(3, 90, (batch, fed), generator=torch.Generator().manual_seed(4))
    m2 = torch.cat([mask, torch.ones_like(more)], 1)
    dyn = DynamicCache(config=model.config)
    with torch.no_grad(), KVPoolCache(pool) as cache:
        for c in (dyn, cache):
            model(input_ids=ids, attention_mask=mask, **{CACHE_KW: c})
        n = ids.shape[1]
        hook = cut_at(model, 1)
        with pytest.raises(Cut):
            model(input_ids=more, attention_mask=m2, **{CACHE_KW: cache})
        hook.remove()
        # Layer 0 stored the step, layers 1 and 2 did not.
        assert [layer.seen for layer in cache._pool_layers] == [n + fed, n, n]
        before = state(pool, cache)
        # What would keep part of the unfinished step, and what would build on it, is refused
        # with the typed error, and changes nothing.
        if fed > 1:
            with pytest.raises(IncompleteForwardError, match=rf"crop\(-{fed}\)"):
                cache.crop(-1)
            assert state(pool, cache) == before
        with pytest.raises(IncompleteForwardError, match="cut short"):
            model(input_ids=more, attention_mask=m2, **{CACHE_KW: cache})
        assert state(pool, cache) == before
        with pytest.raises(IncompleteForwardError):
            cache.reorder_cache(torch.arange(batch))
        assert state(pool, cache) == before
        # crop drops the unfinished step: every layer, and the pool, back at n tokens.
        cache.crop(-fed)
        assert cache.get_seq_length() == n and cache.get_mask_sizes(fed, 0) == dyn.get_mask_sizes(fed, 0)
        assert pool.allocator.lengths(cache.handles).tolist() == [n] * batch
        # The same forward again gives what the default cache gives, and so does the next step.
        a = model(input_ids=more, attention_mask=m2, **{CACHE_KW: dyn}).logits
        b = model(input_ids=more, attention_mask=m2, **{CACHE_KW: cache}).logits
        assert (a - b).abs().max().item() <= TOL
        nxt = a[:, -1:].argmax(-1)
        m3 = torch.cat([m2, torch.ones_like(nxt)], 1)
        a = model(input_ids=nxt, attention_mask=m3, **{CACHE_KW: dyn}).logits
        b = model(input_ids=nxt, attention_mask=m3, **{CACHE_KW: cache}).logits
        assert (a - b).abs().max().item() <= TOL
        assert cache.get_seq_length() == dyn.get_seq_length() == n + fed + 1
    assert pool.allocator.used_pages == 0 and pool.allocator.open_requests == 0
    pool.allocator.check()


def test_a_cut_short_prefill_crops_to_empty_and_serves_again(model):
    ids, mask = left_padded([7, 4], seed=8)
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_context_len=64)
    with torch.no_grad(), KVPoolCache(pool) as cache:
        hook = cut_at(model, 2)
        with pytest.raises(Cut):
            model(input_ids=ids, attention_mask=mask, **{CACHE_KW: cache})
        hook.remove()
        cache.crop(-ids.shape[1])
        assert cache.get_seq_length() == 0 and pool.allocator.used_pages == 0
        want = model(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask, **{CACHE_KW: cache}).logits
        assert (want - got).abs().max().item() <= TOL
    pool.allocator.check()


def test_a_layer_updated_twice_in_one_forward_is_refused_before_the_pool_changes(model):
    """The same layer called again before the others stored the step: not a new step."""
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_context_len=64)
    k = torch.randn(2, 2, 3, 16)
    with KVPoolCache(pool) as cache:
        cache.update(k, k, 0)
        used = pool.allocator.used_pages
        with pytest.raises(IncompleteForwardError, match="layers? 1, 2") as err:
            cache.update(k, k, 0)
        assert isinstance(err.value, KVPoolError) and isinstance(err.value, RuntimeError)
        assert pool.allocator.used_pages == used and pool.allocator.lengths(cache.handles).tolist() == [3, 3]
        # Layers seeing different numbers of tokens in one forward get the same typed error.
        with pytest.raises(IncompleteForwardError, match="same tokens"):
            cache.update(k[:, :, :1], k[:, :, :1], 1)
    pool.allocator.check()


def test_a_hybrid_cache_with_a_sliding_window_crops_a_forward_cut_short():
    """Gemma 3 with a window shorter than the prompt: the sliding layers' pool keeps only the
    window, and dropping the unfinished decode step still puts every group back."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8, pad_token_id=0,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])
    with torch.inference_mode(False), torch.no_grad():
        torch.manual_seed(0)
        model = transformers.Gemma3ForCausalLM(config).eval()
    ids, mask = left_padded([13, 10], seed=3)
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_requests=4)
    dyn = DynamicCache(config=model.config)
    nxt = torch.tensor([[5], [6]])
    m2 = torch.cat([mask, torch.ones_like(nxt)], 1)
    with torch.no_grad(), KVPoolCache(pool) as cache:
        for c in (dyn, cache):
            model(input_ids=ids, attention_mask=mask, **{CACHE_KW: c})
        hook = cut_at(model, 2)
        with pytest.raises(Cut):
            model(input_ids=nxt, attention_mask=m2, **{CACHE_KW: cache})
        hook.remove()
        with pytest.raises(IncompleteForwardError, match=r"layers 2, 3 .*crop\(-1\)"):
            model(input_ids=nxt, attention_mask=m2, **{CACHE_KW: cache})
        cache.crop(-1)
        for step in range(3):
            a = model(input_ids=nxt, attention_mask=m2, **{CACHE_KW: dyn}).logits
            b = model(input_ids=nxt, attention_mask=m2, **{CACHE_KW: cache}).logits
            assert (a - b).abs().max().item() <= TOL, step
            nxt = a[:, -1:].argmax(-1)
            m2 = torch.cat([m2, torch.ones_like(nxt)], 1)
    assert pool.open_requests == 0
    pool.check()


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_prompt_cut_short_is_not_published_to_the_prefix_cache(model, where):
    """A cache opened with ``prefix_ids=`` publishes its prompt's pages when it closes; pages
    whose step some layers never stored must not be, or the next request with that
    prompt would read K/V that were never written."""
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, 90, (1, 40), generator=g)
    pool = pool_for_model(model, max_tokens=1024, page_size=16, max_context_len=128)
    from _hf_models import greedy

    ref = greedy(model, prompt, None, 6)
    hook = cut_at(model, 1) if where == "prefill" else None
    with pytest.raises(Cut), torch.no_grad(), KVPoolCache(pool, prefix_ids=prompt) as cache:
        if hook is None:
            model(input_ids=prompt, **{CACHE_KW: cache})
            hook = cut_at(model, 1)
            model(input_ids=prompt[:, -1:], **{CACHE_KW: cache})
        else:
            model(input_ids=prompt, **{CACHE_KW: cache})
    hook.remove()
    with KVPoolCache(pool, prefix_ids=prompt) as cache:
        out = greedy(model, prompt, None, 6, cache=cache)
        # A decode step cut short leaves the prompt's pages, published when it began, valid.
        assert int(cache.cached_lens[0]) == (32 if where == "decode" else 0)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        assert (a - b).abs().max().item() <= TOL
    pool.allocator.check()


@pytest.mark.parametrize("prior", [[], [5, 1, 1, 1]], ids=["first-forward", "decoding"])
def test_a_step_that_fails_half_made_refuses_all_but_reset(monkeypatch, prior):
    # A failure after the step's extend and before any layer stored it (an OOM growing a layer
    # buffer) left layer 0 looking like a later layer of that step: the retried forward took the
    # half-made step for its own and returned (and stored) other K/V, or raised AttributeError.
    from kvpool import KVPool
    from kvpool.integrations import _pages

    layers, heads, dim = 3, 1, 4
    pool = KVPool(layers, heads, dim, dtype=torch.float32, num_pages=40, page_size=4, max_requests=4,
                  max_context_len=32)
    gen = torch.Generator().manual_seed(0)
    cache = KVPoolCache(pool)
    for t in prior:
        for layer in range(layers):
            k = torch.randn(2, heads, t, dim, generator=gen)
            cache.update(k, -k, layer)
    real = _pages.StepPages.advance

    def oom(self, *a, **kw):
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(_pages.StepPages, "advance", oom)
    k = torch.randn(2, heads, 3, dim, generator=gen)
    with pytest.raises(torch.OutOfMemoryError):
        cache.update(k, -k, 0)
    monkeypatch.setattr(_pages.StepPages, "advance", real)
    for call in (lambda: cache.update(k, -k, 0), lambda: cache.update(k, -k, 1), lambda: cache.crop(-3),
                 lambda: cache.crop(-1), lambda: cache.handles, lambda: cache.reorder_cache(torch.tensor([1, 0])),
                 lambda: cache.batch_select_indices(torch.tensor([0])), lambda: cache.batch_repeat_interleave(2)):
        with pytest.raises(IncompleteForwardError, match=r"reset\(\) \(or close\(\)\) it"):
            call()
    cache.reset()  # gives the rows back, published nothing
    pool.allocator.check()
    assert pool.allocator.open_requests == 0 and pool.allocator.used_pages == 0
    for layer in range(layers):  # and serves a new batch
        kv = cache.update(k, -k, layer)
        assert torch.equal(kv[0], k) and torch.equal(kv[1], -k)
    cache.close()
