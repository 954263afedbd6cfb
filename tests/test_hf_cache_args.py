"""Bad arguments to ``KVPoolCache``'s batch-wide calls get typed errors (``KVPoolError``
subclasses) that say what would be right, and change nothing: no silent truncation of
float indices, no boolean mask of the wrong length read as a shorter batch, no negative
repeat count closing every row, no float crop count stored as the cache's length."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch

from kvpool import (  # noqa: E402
    InvalidArgumentError,
    KVPool,
    LayerIndexError,
    TensorDeviceError,
    TensorDtypeError,
    TensorShapeError,
    TooManyRequestsError,
)
from kvpool.integrations.transformers import KVPoolCache  # noqa: E402

H, D, LAYERS, B, T = 2, 8, 2, 3, 5


@pytest.fixture
def filled():
    pool = KVPool(LAYERS, H, D, dtype=torch.float32, page_size=4, num_slots=256, max_requests=8, max_context_len=64)
    cache = KVPoolCache(pool)
    g = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        k = torch.randn(B, H, T, D, generator=g)
        cache.update(k, -k, layer)
    yield pool, cache
    cache.close()
    assert pool.allocator.open_requests == 0
    pool.allocator.check()


def snapshot(pool, cache) -> tuple:
    a = pool.allocator
    a.check()
    return (a.open_requests, a.used_pages, a.free_pages, cache.handles.tolist(), cache.requests.length,
            [layer.seen for layer in cache._pool_layers])


BAD = {
    "crop-float": (lambda c: c.crop(-2.5), InvalidArgumentError, "int count"),
    "crop-vector": (lambda c: c.crop(torch.tensor([-1, -2])), InvalidArgumentError, "int count"),
    "crop-str": (lambda c: c.crop("-2"), InvalidArgumentError, "int count"),
    "reorder-float": (lambda c: c.reorder_cache(torch.tensor([0.7, 1.2, 2.9])), TensorDtypeError, "integer"),
    "reorder-bool": (lambda c: c.reorder_cache(torch.tensor([True, False, True])), TensorDtypeError, "integer"),
    "reorder-range": (lambda c: c.reorder_cache(torch.tensor([0, 1, 3])), InvalidArgumentError, "outside the batch"),
    "select-float": (lambda c: c.batch_select_indices(torch.tensor([0.0, 2.0])), TensorDtypeError, "integer"),
    "select-short-mask": (lambda c: c.batch_select_indices(torch.tensor([True, False])), TensorShapeError,
                          "one entry per row"),
    "select-2d-mask": (lambda c: c.batch_select_indices(torch.tensor([[True, False, True]])), TensorShapeError,
                       "one entry per row"),
    "repeat-negative": (lambda c: c.batch_repeat_interleave(-1), InvalidArgumentError, "repeats"),
    "repeat-float": (lambda c: c.batch_repeat_interleave(2.5), InvalidArgumentError, "repeats"),
    "update-layer": (lambda c: c.update(torch.zeros(B, H, 1, D), torch.zeros(B, H, 1, D), LAYERS), LayerIndexError,
                     "layers"),
    # (a list of B x repeats rows was built first: 2**63 ran out of memory after a minute, untyped)
    "repeat-huge": (lambda c: c.batch_repeat_interleave(2**63), TooManyRequestsError, r"max_requests=8"),
    "repeat-past-max": (lambda c: c.batch_repeat_interleave(1000), TooManyRequestsError, r"makes 3 x 1000 = 3000 rows"),
    # (3 x 2**62 wraps to -2**62 in int64: the check must not multiply numpy ints)
    "repeat-numpy-wrap": (lambda c: c.batch_repeat_interleave(np.int64(2**62)), TooManyRequestsError, "max_requests"),
    # (.tolist() of a meta tensor raised NotImplementedError)
    "reorder-meta": (lambda c: c.reorder_cache(torch.tensor([2, 1, 0], device="meta")), TensorDeviceError, "meta"),
    "select-meta": (lambda c: c.batch_select_indices(torch.tensor([0, 2], device="meta")), TensorDeviceError, "meta"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_are_typed_errors_that_change_nothing(filled, case):
    call, error, match = BAD[case]
    pool, cache = filled
    before = snapshot(pool, cache)
    with pytest.raises(error, match=match):
        call(cache)
    assert snapshot(pool, cache) == before
    # Still usable: the next step of every layer reads back what was stored.
    for layer in range(LAYERS):
        k, _ = cache.update(torch.ones(B, H, 1, D), torch.ones(B, H, 1, D), layer)
        assert k.shape == (B, H, T + 1, D)


LAYOUTS = {"sparse": lambda t: t.to_sparse(), "mkldnn": lambda t: t.to_mkldnn()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_k_v_of_another_layout_are_refused_mid_generation(filled, layout):
    """Sparse or mkldnn K/V passed the short way's test (dtype, shape, device): the step
    began (the rows extended), then torch's copy refused it untyped, or, on a hybrid pool,
    ``index_copy_`` of mkldnn rows crashed the process. Refused first now."""
    pool, cache = filled
    before = snapshot(pool, cache)
    k = LAYOUTS[layout](torch.ones(B, H, 1, D))
    with torch.no_grad(), pytest.raises(TensorShapeError, match="dense"):
        cache.update(k, k, 0)
    assert snapshot(pool, cache) == before
    for layer in range(LAYERS):
        assert cache.update(torch.ones(B, H, 1, D), torch.ones(B, H, 1, D), layer)[0].shape == (B, H, T + 1, D)


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_k_v_of_another_layout_open_nothing_on_the_first_forward(layout, hybrid):
    kw = dict(layer_types=["full_attention"] * LAYERS) if hybrid else {}
    pool = KVPool(LAYERS, H, D, dtype=torch.float32, page_size=4, num_slots=256, max_requests=8,
                  max_context_len=64, **kw)
    cache = KVPoolCache(pool)
    k = LAYOUTS[layout](torch.ones(1, H, 2, D))
    with torch.no_grad(), pytest.raises(TensorShapeError, match="dense"):
        cache.update(k, k, 0)
    assert pool.allocator.open_requests == 0


@pytest.mark.parametrize("bad, error", [
    (lambda ids: ids.to("meta"), TensorDeviceError),
    (lambda ids: ids.to_sparse(), TensorShapeError),
], ids=["meta", "sparse"])
def test_prefix_ids_without_values_are_typed_errors(bad, error):
    pool = KVPool(LAYERS, H, D, dtype=torch.float32, page_size=4, num_slots=256, max_context_len=64)
    with pytest.raises(error, match="prefix_ids"):
        KVPoolCache(pool, prefix_ids=bad(torch.tensor([[3, 4, 5, 6]])))
    assert pool.allocator.open_requests == 0


@pytest.mark.parametrize("count", [np.int64(-2), torch.tensor(-2)], ids=["numpy", "tensor"])
def test_crop_takes_integer_scalars_and_keeps_an_int_length(filled, count):
    pool, cache = filled
    cache.crop(count)
    assert type(cache.requests.length) is int and cache.requests.length == T - 2
    assert all(type(layer.seen) is int for layer in cache._pool_layers)
    assert type(cache.get_seq_length()) is int and cache.get_mask_sizes(1, 0) == (T - 1, 0)
    assert pool.allocator.lengths(cache.handles).tolist() == [T - 2] * B


def test_float_prefix_ids_are_a_typed_error_and_open_nothing():
    pool = KVPool(LAYERS, H, D, dtype=torch.float32, page_size=4, num_slots=256, max_context_len=64)
    with pytest.raises(TensorDtypeError, match="token ids"):
        KVPoolCache(pool, prefix_ids=torch.tensor([[3.0, 4.5, 5.0, 6.0]]))
    assert pool.allocator.open_requests == 0


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(max_tokens=64, page_size=0), "page_size"),
    (dict(max_tokens=64, page_size=-16), "page_size"),
    (dict(max_tokens=64, page_size=4.0), "page_size"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(max_tokens=64, max_context_len=0), "max_context_len"),
    (dict(max_tokens=64, max_context_len=-8), "max_context_len"),
])
def test_pool_for_model_sizes_are_checked_with_typed_errors(kwargs, match):
    from transformers import LlamaConfig

    from kvpool.integrations.transformers import pool_for_model

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    with pytest.raises(InvalidArgumentError, match=match):
        pool_for_model(config, **kwargs)


@pytest.mark.parametrize("kwargs, ctx", [(dict(page_size=16), 100), (dict(page_size=4, max_context_len=15), 15),
                                         (dict(page_size=3), 100)])
def test_pool_for_model_keeps_the_context_limit_it_was_given(kwargs, ctx):
    # Rounded up to a page multiple, a request past the model's position table (or the caller's
    # limit) was admitted; the pool takes any max_context_len.
    from transformers import LlamaConfig

    from kvpool import ContextTooLongError
    from kvpool.integrations.transformers import pool_for_model

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=100)
    pool = pool_for_model(config, max_tokens=256, **kwargs)
    assert pool.max_context_len == ctx
    with pytest.raises(ContextTooLongError):
        pool.admit([ctx + 1])
    assert pool.allocator.open_requests == 0


@pytest.mark.parametrize("kwargs, recorded", [({}, 0), ({"kv_events": True}, 2)])
def test_pool_for_model_records_kv_events_only_when_asked(kwargs, recorded):
    """docs/allocator.md: ``pool_for_model`` builds its pool with ``kv_events=False``
    (``KVPoolCache`` never drains them); ``kv_events=True`` turns them back on."""
    from transformers import LlamaConfig

    from kvpool.integrations.transformers import pool_for_model

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    pool = pool_for_model(config, max_tokens=64, page_size=4, max_requests=2, **kwargs)
    h, _ = pool.open_with_prefix(np.arange(9), [9])
    pool.extend(h, 9)
    pool.cache(h)
    assert len(pool.take_events()["kind"]) == recorded  # two full pages registered


def test_salt_keys_the_prefix_lookup_and_needs_prefix_ids():
    """docs/transformers.md: ``salt=`` keys the prefix lookup (a tenant's pages serve only that
    tenant) and is refused without ``prefix_ids=``."""
    pool = KVPool(LAYERS, H, D, dtype=torch.float32, page_size=4, num_slots=256, max_requests=8, max_context_len=64)
    prompt = list(range(1, 14))
    h, _ = pool.open_with_prefix(prompt, [len(prompt)], 1)
    pool.extend(h, len(prompt))
    pool.close(h, cache=True)  # 3 full pages cached under salt 1
    with pytest.raises(InvalidArgumentError, match="prefix_ids"):
        KVPoolCache(pool, salt=1)
    assert pool.open_requests == 0
    hits = {}
    for salt in (1, 2, None):
        cache = KVPoolCache(pool, prefix_ids=torch.tensor([prompt]), salt=salt)
        hits[salt] = cache.get_seq_length()
        cache.close()
    assert hits == {1: 12, 2: 0, None: 0}
    pool.allocator.check()


def test_a_hybrid_reorder_past_max_requests_is_refused_before_any_fork():
    """The hybrid cache forked row by row, then closed the forks when one was refused: the
    closed forks' table rows were rewritten, and the message named one fork of a full pool."""
    pool = KVPool(LAYERS, H, D, dtype=torch.float32, page_size=4, num_slots=256, max_requests=4, max_context_len=64,
                  layer_types=["full_attention", "sliding_attention"], sliding_window=4)
    cache = KVPoolCache(pool)
    for layer in range(LAYERS):
        k = torch.randn(B, H, T, D)
        cache.update(k, -k, layer)
    cache.flush()
    before = {n: t.clone() for n, t in pool.named_tensors()}
    handles = cache.handles
    # (six rows from three: closing the two dropped rows first would still leave too few)
    with pytest.raises(TooManyRequestsError, match="fork asks for 5 new requests .* 3 of max_requests=4 .* at most 1"):
        cache.reorder_cache(torch.tensor([0, 0, 0, 0, 0, 0]))
    assert pool.open_requests == B and np.array_equal(cache.handles, handles)
    changed = [n for n, t in pool.named_tensors() if not torch.equal(before[n], t)]
    assert not changed, changed
    pool.check()
    cache.close()
