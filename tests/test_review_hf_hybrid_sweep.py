"""Outside-style checks of ``HybridKVPoolCache`` on linear-attention models (tiny random Qwen3-Next,
float32 and bfloat16, CPU): parity with transformers' ``DynamicCache`` in bfloat16, and typed refusals
(the cache usable afterwards) for the linear-attention calls given bad indices or states, and for a
pool built for another model. Bounded: 4-layer, hidden-64 models, a few tokens per case."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _hf_hybrid_models import P, tiny  # noqa: I001  (skips without transformers)
from _hf_models import greedy, left_padded
from transformers import DynamicCache

from kvpool.errors import InvalidArgumentError, LayerIndexError, TensorDeviceError, TensorDtypeError, TensorShapeError
from kvpool.integrations.transformers import KVPoolCache, pool_for_model


@pytest.fixture(scope="module")
def qwen():
    return tiny("qwen3_next")


def test_a_bf16_linear_attention_model_keeps_a_float32_recurrent_state_and_dynamic_caches_tokens():
    """transformers' gated delta rule returns the recurrent state in float32 and DynamicCache keeps
    it so; pool_for_model gave it the model's bf16, which rounded it at every step: logits drifted
    from the first decode step and a batch's tokens differed within 16."""
    model = tiny("qwen3_next").to(torch.bfloat16)
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=4)
    assert pool.state_shapes["recurrent"] == ((4, 8, 8), torch.float32)
    assert pool.state_shapes["conv"] == ((64, 4), torch.bfloat16)  # (DynamicCache's conv state is the model's)
    ids, mask = left_padded([12, 5, 9], seed=3)
    ref = greedy(model, ids, mask, 16, DynamicCache(config=model.config))
    with KVPoolCache(pool) as cache:
        out = greedy(model, ids, mask, 16, cache)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        assert torch.equal(a, b)
    pool.check()


def _filled(model):
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=8)
    ids, mask = left_padded([7, 5], seed=1)
    cache = KVPoolCache(pool)
    greedy(model, ids, mask, 3, cache)
    return pool, cache, ids, mask


CALLS = {
    "get_conv_state": lambda c, layer, state: c.get_conv_state(layer, state),
    "get_recurrent_state": lambda c, layer, state: c.get_recurrent_state(layer, state),
    "update_conv_state": lambda c, layer, state: c.update_conv_state(torch.zeros(2, 64, 1), layer, state),
    "update_recurrent_state": lambda c, layer, state: c.update_recurrent_state(torch.zeros(2, 4, 8, 8), layer, state),
    "has_previous_state": lambda c, layer, state: c.has_previous_state(layer, state),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize(("layer", "state", "error", "match"), [
    (1, 0, InvalidArgumentError, r"layer 1 of the pool is a full attention layer.*pool_for_model\(model\)"),
    (-1, 0, LayerIndexError, r"layer_idx -1: the pool has layers \[0, 4\)"),
    (True, 0, LayerIndexError, "got bool True"),
    (1.0, 0, LayerIndexError, "got float 1.0"),
    (0, 1, InvalidArgumentError, r"state_idx 1: layer 0 keeps 1 state"),
    (0, True, InvalidArgumentError, "state_idx takes an int, got bool"),
    (0, 1.0, InvalidArgumentError, "state_idx takes an int, got float"),
], ids=["attention-layer", "negative", "bool", "float", "state-1", "state-bool", "state-float"])
def test_the_linear_attention_calls_check_their_indices(qwen, call, layer, state, error, match):
    """transformers' Cache raised ValueError, KeyError, IndexError or TypeError for these."""
    pool, cache, ids, mask = _filled(qwen)
    n, before = cache.get_seq_length(), pool.state(0, "recurrent").clone()
    with pytest.raises(error, match=match):
        CALLS[call](cache, layer, state)
    assert cache.get_seq_length() == n and torch.equal(pool.state(0, "recurrent"), before)
    assert CALLS["has_previous_state"](cache, 99, None) is False  # (past the last layer: False, as transformers)
    assert CALLS["get_conv_state"](cache, np.int64(0), 0) is not None  # (a numpy int is an int)
    cache.close()
    pool.check()
    assert pool.open_requests == 0


@pytest.mark.parametrize(("kind", "x", "error", "match"), [
    ("conv", torch.zeros(2, 60, 1), TensorShapeError, r"new conv state must be \[batch, 64, columns\].*\[2, 60, 1\]"),
    ("conv", torch.zeros(2, 64), TensorShapeError, "new conv state must be"),
    ("conv", "x", TensorShapeError, "got str"),
    ("conv", torch.zeros(2, 64, 1, dtype=torch.int64), TensorDtypeError, "torch.int64; the pool keeps it as torch.float32"),
    ("recurrent", torch.zeros(2, 4, 8), TensorShapeError, r"must be \[batch, 4, 8, 8\]"),
    ("recurrent", None, TensorShapeError, "got NoneType"),
    ("recurrent", torch.zeros(3, 4, 8, 8), TensorShapeError, "the batch has 3 rows but this cache holds 2"),
], ids=["conv-channels", "conv-ndim", "conv-str", "conv-int", "recurrent-shape", "recurrent-none", "recurrent-batch"])
def test_a_new_state_of_the_wrong_shape_dtype_or_batch_is_typed_and_changes_nothing(qwen, kind, x, error, match):
    """torch's RuntimeError / TypeError from the cat or copy_ before; now the cache's typed error, the
    pool's states untouched, and the cache goes on with the next forward."""
    pool, cache, ids, mask = _filled(qwen)
    before = {name: pool.state(0, name).clone() for name in ("conv", "recurrent")}
    with pytest.raises(error, match=match):
        getattr(cache, f"update_{kind}_state")(x, 0)
    assert all(torch.equal(pool.state(0, name), t) for name, t in before.items())
    cache.close()
    pool.check()


def test_a_forward_of_another_batch_size_is_typed_and_the_right_one_then_goes_on(qwen):
    """Qwen3-Next's first layer is linear attention: a generate with 1 row on a cache of 2 raised torch's
    RuntimeError from the conv state's cat. Now TensorShapeError (as an attention layer refuses it), and
    the state read before the refusal does not make the next forward look cut short."""
    pool, cache, ids, mask = _filled(qwen)
    dyn = DynamicCache(config=qwen.config)
    first = greedy(qwen, ids, mask, 3, dyn)
    with pytest.raises(TensorShapeError, match="the batch has 1 rows but this cache holds 2"):
        greedy(qwen, ids[:1], mask[:1], 2, cache)
    more = torch.cat([first.sequences, torch.tensor([[5], [6]])], 1)
    mask = torch.cat([mask, torch.ones(2, more.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    assert torch.equal(greedy(qwen, more, mask, 3, cache).sequences, greedy(qwen, more, mask, 3, dyn).sequences)
    cache.close()
    pool.check()


@pytest.mark.parametrize(("pool_arch", "model_arch", "match"), [
    ("qwen3_next", "gemma3", r"KVPoolCache.update: layer 0 of the pool is a linear-attention \(state\) layer"),
    ("gemma3", "qwen3_next", r"layer 0 of the pool is a sliding-window attention layer, which keeps no state"),
])
def test_a_pool_built_for_another_model_is_named_as_such(pool_arch, model_arch, match):
    """A state layer given attention K/V raised AttributeError ('PoolStateLayer' object has no attribute
    'update'); an attention layer asked for a state, transformers' ValueError. The cache is usable after."""
    pool = pool_for_model(tiny(pool_arch), max_tokens=256, page_size=P, max_requests=4)
    model = tiny(model_arch)
    ids, mask = left_padded([6, 4], seed=2)
    with KVPoolCache(pool) as cache:
        with pytest.raises(InvalidArgumentError, match=match + r".*pool_for_model\(model\)"):
            greedy(model, ids, mask, 2, cache)
        assert pool.open_requests == 0
        right = tiny(pool_arch)
        assert torch.equal(greedy(right, ids, mask, 4, cache).sequences,
                           greedy(right, ids, mask, 4, DynamicCache(config=right.config)).sequences)
    pool.check()


def test_a_pool_keeping_a_state_as_ints_is_refused_not_truncated(qwen):
    """state_shapes may give a state an int dtype (an engine's own counters), but a model's float state
    copied into it was truncated silently: other tokens than DynamicCache's. Now TensorDtypeError."""
    pool = pool_for_model(qwen, max_tokens=256, page_size=P, max_requests=4,
                          state_shapes={"conv": ((64, 4), torch.int32), "recurrent": (4, 8, 8)})
    ids, mask = left_padded([6], seed=2)
    with KVPoolCache(pool) as cache:
        with pytest.raises(TensorDtypeError, match=r"conv state is torch.float32; the pool keeps it as torch.int32"):
            greedy(qwen, ids, mask, 2, cache)
    assert pool.open_requests == 0
    pool.check()


def test_nothing_the_cache_makes_under_inference_mode_is_an_inference_tensor(qwen):
    """docs/grad-modes.md: a cache made and driven under inference_mode keeps only normal tensors."""
    with torch.inference_mode():
        pool = pool_for_model(qwen, max_tokens=256, page_size=P, max_requests=4)
        ids, mask = left_padded([7, 4], seed=5)
        cache = KVPoolCache(pool)
        greedy(qwen, ids, mask, 5, cache)
        kept = [t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
        kept += [t for layer in cache.layers if hasattr(layer, "_rows") for t in layer._rows.values()]
        kept += [t for layer in cache.layers if hasattr(layer, "_slots") and layer._slots is not None
                 for t in [layer._slots]]
        kept += [t for t in vars(cache.requests).values() if isinstance(t, torch.Tensor)]
        kept += list(cache.requests._index.values()) + list(cache.requests._new)
        kept += [t for _, t in pool.named_tensors()]
        assert kept and not any(t.is_inference() for t in kept)
        cache.close()
    with KVPoolCache(pool) as again:  # (and outside it, the pool serves a new cache)
        greedy(qwen, ids, mask, 3, again)


@pytest.mark.parametrize("arch", ["qwen3_next", "gemma3"])
@pytest.mark.parametrize(("ids", "error", "match"), [
    (torch.ones(1, 5, dtype=torch.long, device="meta"), TensorDeviceError, "meta tensor"),
    (torch.ones(1, 5, dtype=torch.long).to_sparse(), TensorShapeError, None),
], ids=["meta", "sparse"])
def test_prefix_ids_without_values_are_refused_as_on_a_plain_pool(arch, ids, error, match):
    """The hybrid cache skipped the plain cache's checks: meta prefix_ids raised torch's
    NotImplementedError ('Cannot copy out of meta tensor')."""
    pool = pool_for_model(tiny(arch), max_tokens=64, page_size=P, max_requests=2)
    with pytest.raises(error, match=match):
        KVPoolCache(pool, prefix_ids=ids)
    assert pool.open_requests == 0
