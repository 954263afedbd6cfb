"""What transformers asks a ``KVPoolCache`` at every step, beyond ``update``: the
layer-kind properties (``is_compileable``, ``is_sliding``, ``is_linear``, ``is_dummy``) that
``generate``'s inputs and the masks read at every forward. The cache takes them once from
``Cache``'s own properties (its layers never change kind), so a ``generate`` no longer walks the
layers for them at each step; the answers stay ``Cache``'s, and each list read is a new list.

Bounded: 2- and 4-layer hidden-64 models (float32, CPU), a few tokens per case."""

from __future__ import annotations

import pytest
import torch
from _hf_hybrid_models import tiny  # noqa: I001  (skips without transformers)
from _hf_models import CACHE_KW, PAD, tiny_model
from transformers import DynamicCache
from transformers.cache_utils import Cache

from kvpool.integrations.transformers import KVPoolCache, pool_for_model

KINDS = ("is_compileable", "is_sliding", "is_linear", "is_dummy")


@pytest.fixture(scope="module")
def models():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {"llama": tiny_model("llama"), "gemma3": tiny("gemma3"), "qwen3_next": tiny("qwen3_next")}
    torch.set_num_threads(threads)


def _cache(model):
    return KVPoolCache(pool_for_model(model, max_tokens=256, page_size=4, max_context_len=64))


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_next"])
def test_layer_kinds_are_caches_own_answers_and_fresh_lists(models, arch):
    with _cache(models[arch]) as cache:
        for name in KINDS:
            assert getattr(cache, name) == getattr(Cache, name).fget(cache), name
        if arch == "gemma3":
            assert cache.is_sliding == [True, True, True, False]
        if arch == "qwen3_next":
            assert cache.is_linear == [True, False, True, False]
        got = cache.is_sliding
        got.append("x")
        got[0] = "y"
        assert cache.is_sliding == Cache.is_sliding.fget(cache)  # (a caller's edit of one list stays its own)


def test_a_replaced_or_resized_layer_list_gets_caches_own_answers(models):
    with _cache(models["gemma3"]) as cache:
        layers = cache.layers
        cache.layers = layers[3:]  # (the full-attention layer alone)
        assert cache.is_sliding == [False]
        cache.layers = layers
        layers.pop(0)
        assert cache.is_sliding == [True, True, False]
        layers.insert(0, layers[-1])
        assert cache.is_sliding == [False, True, True, False]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_generate_does_not_walk_the_layers_for_their_kinds(models, arch, monkeypatch):
    """Counts of ``Cache``'s own layer-kind properties during ``generate``: none (each forward read
    them before, e.g. ``is_compileable`` twice), with the tokens of a ``DynamicCache``."""
    model = models[arch]
    ids = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=PAD)
    want = model.generate(ids, **{CACHE_KW: DynamicCache(config=model.config)}, **kw)
    with _cache(model) as cache:
        calls = dict.fromkeys(KINDS, 0)
        for name in KINDS:
            fget = getattr(Cache, name).fget

            def counted(self, _fget=fget, _name=name):
                calls[_name] += 1
                return _fget(self)
            monkeypatch.setattr(Cache, name, property(counted))
        got = model.generate(ids, **{CACHE_KW: cache}, **kw)
        monkeypatch.undo()
    assert torch.equal(got, want)
    assert calls == dict.fromkeys(KINDS, 0)
