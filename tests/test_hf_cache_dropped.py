"""A KVPoolCache collected with rows open warns (ResourceWarning, as an unclosed file does):
nothing closes its requests, and a shared pool refuses new ones after max_requests / batch
such caches. A closed cache, or one that never opened rows, says nothing."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch
import kvpool  # noqa: E402
from kvpool.integrations.transformers import KVPoolCache  # noqa: E402


def _pool(**kw):
    return kvpool.KVPool(2, 2, 4, dtype=torch.float32, page_size=4, num_slots=256, max_requests=4,
                         max_context_len=64, **kw)


def _dropped(pool, close: bool, update: bool = True) -> list:
    cache = KVPoolCache(pool)
    if update:
        for layer in range(2):
            k = torch.randn(2, 2, 3, 4)
            cache.update(k, -k, layer)
    if close:
        cache.close()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del cache
        gc.collect()
    return [w for w in seen if issubclass(w.category, ResourceWarning)]


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_cache_dropped_with_rows_open_warns(hybrid):
    kw = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4) if hybrid else {}
    pool = _pool(**kw)
    seen = _dropped(pool, close=False)
    assert len(seen) == 1 and "holding 2 rows was dropped without close()" in str(seen[0].message)
    assert pool.open_requests == 2  # (not closed behind the engine's back)
    assert _dropped(pool, close=True) == [] and _dropped(pool, close=False, update=False) == []


_KINDS = {
    "plain": {},
    "sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4),
    "linear": dict(layer_types=["full_attention", "linear_attention"], state_shapes={"conv": (6, 4)}),
}


@pytest.mark.parametrize("kind", sorted(_KINDS))
@pytest.mark.parametrize("close", [True, False])
def test_a_dropped_cache_and_pool_are_freed_by_reference_counting(kind, close):
    # The cache's requests held its layers and each layer the requests: a cycle that kept the
    # requests, their layer buffers and the pool (its K/V) alive until the cyclic collector ran
    # (on a server, a rare full collection; unclosed, it took two).
    import weakref

    pool = _pool(**_KINDS[kind])
    cache = KVPoolCache(pool)
    for layer in cache._pool_layers:
        k = torch.randn(2, 2, 3, 4)
        cache.update(k, -k, layer.layer_idx)
    if close:
        cache.close()
    refs = [weakref.ref(x) for x in (pool, cache, cache.requests, *cache._pool_layers)]
    storage = weakref.ref(pool.k_buffer(cache._pool_layers[0].layer_idx).untyped_storage())
    gc.collect()
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            del cache, pool, layer
        assert [r() is None for r in refs] == [True] * len(refs)
        assert storage() is None
    finally:
        gc.enable()


def test_a_linear_layers_states_read_after_its_cache_was_dropped_raise_a_typed_error():
    # conv_states / recurrent_states hold their layer weakly (the layer holds them): kept past the
    # cache, they say so with a kvpool error, not an AttributeError on None; while it lives they read.
    pool = _pool(**_KINDS["linear"])
    cache = KVPoolCache(pool)
    k = torch.randn(2, 2, 3, 4)
    cache.update(k, -k, 0)
    cache.update_conv_state(torch.ones(2, 6, 4), 1)
    states = cache.layers[1].conv_states
    assert torch.equal(states[0], torch.ones(2, 6, 4)) and cache.layers[1].recurrent_states[0] is None
    cache.close()
    del cache
    gc.collect()
    with pytest.raises(kvpool.InvalidArgumentError, match="cache layer that is gone"):
        states[0]  # noqa: B018
    with pytest.raises(kvpool.InvalidArgumentError, match="cache layer that is gone"):
        states[0] = torch.zeros(2, 6, 4)
    assert pool.open_requests == 0
