"""Outside-style checks of ``KVPoolCache`` driven as a transformers user drives it: the layer
index of ``get_seq_length`` / ``get_mask_sizes`` (typed refusals, not transformers' TypeError),
a pool built with more layers than the model (the refusal names that, not only a forward cut
short), and ``generate`` combinations the other HF tests leave out (an assistant model, eos
stopping one row early with a repetition penalty, and a returned cache passed back with a
longer input), each against transformers' ``DynamicCache``.

Bounded: 2-layer, hidden-64 models (float32, CPU), a few tokens per case."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _hf_hybrid_models import MODELS as HYBRID  # noqa: I001  (skips without transformers)
from _hf_hybrid_models import tiny
from _hf_models import CACHE_KW, PAD, left_padded, tiny_model, transformers
from transformers import DynamicCache

from kvpool import IncompleteForwardError, LayerIndexError
from kvpool.integrations.transformers import KVPoolCache, pool_for_model


@pytest.fixture(scope="module")
def llama():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_model("llama")
    torch.set_num_threads(threads)


def _gemma3(layers: int):
    config_name, model_name, extra = HYBRID["gemma3"]
    kw = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, **dict(extra, layer_types=["sliding_attention", "full_attention"][-layers:]
                                                 if layers <= 2 else ["sliding_attention"] * (layers - 1)
                                                 + ["full_attention"]))
    config = getattr(transformers, config_name)(**kw)
    with torch.inference_mode(False), torch.no_grad():
        torch.manual_seed(0)
        return getattr(transformers, model_name)(config).eval(), config


def _generate(model, ids, mask=None, cache=None, **kw):
    kw = dict(dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD), **kw)
    if mask is not None:
        kw["attention_mask"] = mask
    if cache is not None:
        kw[CACHE_KW] = cache
    torch.manual_seed(7)
    return model.generate(ids, **kw)


# -- layer indices of the length queries -------------------------------------------------------

@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
@pytest.mark.parametrize("bad", ["0", None, 1.0, True, torch.tensor([0]), torch.tensor(0.0)],
                         ids=["str", "None", "float", "bool", "vector", "float-tensor"])
def test_length_queries_refuse_a_layer_index_that_is_not_an_int(llama, hybrid, bad):
    """``get_seq_length("0")`` and ``get_mask_sizes(q, None)`` raised transformers' TypeError
    ("'>=' not supported ..."); ``True`` read layer 1. Integer scalars of any kind still answer."""
    model = _gemma3(2)[0] if hybrid else llama
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_context_len=64)
    with KVPoolCache(pool) as cache:
        _generate(model, torch.tensor([[5, 6, 7, 8]]), cache=cache, max_new_tokens=2)
        n = cache.get_seq_length()
        with pytest.raises(LayerIndexError, match="takes an int layer index"):
            cache.get_seq_length(bad)
        with pytest.raises(LayerIndexError, match="takes an int layer index"):
            cache.get_mask_sizes(torch.arange(1), bad)
        for good in (1, np.int64(1), torch.tensor(1)):
            assert cache.get_seq_length(good) == n == 5
        assert cache.get_seq_length(99) == 0  # (transformers: a layer past the last holds nothing)
        # Unchanged and usable: the next generate continues from the cache.
        assert _generate(model, torch.tensor([[5, 6, 7, 8, 9, 10]]), cache=cache, max_new_tokens=2).shape[1] == 8


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
def test_length_queries_refuse_a_negative_index_before_the_first_layer(llama, hybrid):
    """A negative index counts from the end (as transformers'), but one before the first layer
    reached transformers' list indexing: an untyped IndexError ("list index out of range")."""
    model = _gemma3(2)[0] if hybrid else llama
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_context_len=64)
    with KVPoolCache(pool) as cache:
        _generate(model, torch.tensor([[5, 6, 7, 8]]), cache=cache, max_new_tokens=2)
        layers = len(cache.layers)
        for i in range(1, layers + 1):
            assert cache.get_seq_length(-i) == 5
            assert cache.get_mask_sizes(1, -i) == cache.get_mask_sizes(1, layers - i)
        for bad in (-layers - 1, -100, np.int64(-layers - 1), torch.tensor(-layers - 1)):
            with pytest.raises(LayerIndexError, match=rf"layer_idx {int(bad)}: the cache has layers \[0, {layers}\)"):
                cache.get_seq_length(bad)
            with pytest.raises(LayerIndexError, match="down to"):
                cache.get_mask_sizes(1, bad)
        assert _generate(model, torch.tensor([[5, 6, 7, 8, 9, 10]]), cache=cache, max_new_tokens=2).shape[1] == 8


# -- a pool with more layers than the model ---------------------------------------------------------

@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
def test_a_pool_with_more_layers_than_the_model_says_so(llama, hybrid):
    """The model's forward updates layers 0-1 of a 3-layer pool: the next forward was refused as
    "the last forward was cut short ... crop(-5) drops the unfinished step", advice that fails
    again at every forward. The refusal now also names the layer counts and what to build."""
    if hybrid:
        model, _ = _gemma3(2)
        pool = pool_for_model(_gemma3(3)[1], max_tokens=256, page_size=4, max_context_len=64)
    else:
        model = llama
        pool = pool_for_model(tiny_model("llama", num_hidden_layers=3).config, max_tokens=256, page_size=4,
                              max_context_len=64)
    with KVPoolCache(pool) as cache:
        with pytest.raises(IncompleteForwardError, match=r"fewer layers than the pool: the pool's layers 2 and up were "
                                                         r"never updated; build the pool for this model"):
            _generate(model, torch.tensor([[5, 6, 7, 8, 9]]), cache=cache)
    assert pool.allocator.open_requests == 0


def test_a_forward_cut_short_in_a_middle_layer_is_not_taken_for_missing_layers(llama):
    """Only the pool's last layers left behind by one count read as a model with fewer layers."""
    pool = pool_for_model(llama, max_tokens=256, page_size=4, max_context_len=64)
    with KVPoolCache(pool) as cache:
        for layer in range(2):
            cache.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), layer)
        cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 1)  # (layer 0 never saw this step)
        with pytest.raises(IncompleteForwardError) as e:
            cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 1)
        assert "fewer layers" not in str(e.value)


# -- generate combinations --------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 16])
def test_an_assistant_model_gives_dynamic_caches_tokens_and_rolls_back(llama, page_size):
    """Assisted decoding crops the rejected draft tokens at every step (``crop`` into deferred
    steps, across page boundaries with page_size 1)."""
    assistant = tiny_model("llama", seed=1)
    ids = torch.randint(3, 90, (1, 9), generator=torch.Generator().manual_seed(2))
    pool = pool_for_model(llama, max_tokens=512, page_size=page_size, max_context_len=64)
    with KVPoolCache(pool) as cache:
        got = _generate(llama, ids, cache=cache, assistant_model=assistant, max_new_tokens=10)
        pool.allocator.check()
    assert torch.equal(got, _generate(llama, ids, assistant_model=assistant, max_new_tokens=10))
    assert pool.allocator.open_requests == 0 and pool.allocator.used_pages == 0


def test_eos_in_one_row_with_a_repetition_penalty_then_the_cache_passed_back(llama):
    """A left-padded batch whose first row meets eos early (the others go on), with a repetition
    penalty; then the returned cache is passed back with the answers and a new user turn, twice."""
    ids, mask = left_padded([7, 12, 3], seed=3)
    first = _generate(llama, ids, mask, max_new_tokens=10)
    eos = int(first[0, ids.shape[1] + 2])  # row 0's third new token
    kw = dict(eos_token_id=eos, repetition_penalty=1.3, max_new_tokens=8, return_dict_in_generate=True)
    pool = pool_for_model(llama, max_tokens=1024, page_size=4, max_context_len=96)
    dyn = DynamicCache(config=llama.config)
    with KVPoolCache(pool) as cache:
        a = b = ids
        for turn in range(3):
            ra, rb = _generate(llama, a, mask, cache=cache, **kw), _generate(llama, b, mask, cache=dyn, **kw)
            assert ra.past_key_values is cache
            assert torch.equal(ra.sequences, rb.sequences)
            assert cache.get_seq_length() == dyn.get_seq_length()
            user = torch.randint(3, 90, (3, 2), generator=torch.Generator().manual_seed(turn))
            a, b = torch.cat([ra.sequences, user], 1), torch.cat([rb.sequences, user], 1)
            mask = torch.cat([mask, torch.ones(3, a.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        assert (a[0] == eos).any()  # (row 0 did stop early in the first turn)
        pool.allocator.check()
    assert pool.allocator.open_requests == 0


# -- reset / close between two layers of a forward --------------------------------------------------

@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
@pytest.mark.parametrize("call", ["reset", "close"])
def test_a_reset_between_two_layers_refuses_the_rest_of_that_forward(llama, hybrid, call):
    """A hook before layer 1 resets the cache: layer 1 then opened new rows and attended to its own
    token alone (silently wrong logits on Llama; on Gemma 3 transformers' mask shape error). Now
    layer 1's update is refused (typed, nothing opened) and the next forward serves a new batch."""
    model = _gemma3(2)[0] if hybrid else llama
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_context_len=64)
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(1))
    with KVPoolCache(pool) as cache:
        _generate(model, ids, cache=cache, max_new_tokens=3)
        fired = []

        def pre(module, args, kwargs):
            if not fired:
                fired.append(getattr(cache, call)())
        hook = model.model.layers[1].register_forward_pre_hook(pre, with_kwargs=True)
        try:
            with pytest.raises(IncompleteForwardError, match=r"reset \(or closed\) during this forward.*layer 1"):
                with torch.no_grad():
                    model(input_ids=torch.full((2, 1), 9), use_cache=True, **{CACHE_KW: cache})
        finally:
            hook.remove()
        assert fired and pool.allocator.open_requests == 0 and cache.get_seq_length() == 0
        assert torch.equal(_generate(model, ids, cache=cache, max_new_tokens=3), _generate(model, ids, max_new_tokens=3))
    assert pool.allocator.open_requests == 0


@pytest.mark.parametrize("calls", [("reset", "reset"), ("close", "close"), ("reset", "close")])
def test_a_second_reset_between_two_layers_keeps_the_refusal(llama, calls):
    """close() is idempotent, so a hook (or the engine) may call it twice: the second call found
    an empty cache and cleared what the first had noted, and layer 1 opened new rows again."""
    pool = pool_for_model(llama, max_tokens=256, page_size=4, max_context_len=64)
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(1))
    with KVPoolCache(pool) as cache:
        _generate(llama, ids, cache=cache, max_new_tokens=3)
        fired = []

        def pre(module, args, kwargs):
            if not fired:
                fired.extend(getattr(cache, c)() for c in calls)
        hook = llama.model.layers[1].register_forward_pre_hook(pre, with_kwargs=True)
        try:
            with pytest.raises(IncompleteForwardError, match=r"reset \(or closed\) during this forward"):
                with torch.no_grad():
                    llama(input_ids=torch.full((2, 1), 9), use_cache=True, **{CACHE_KW: cache})
        finally:
            hook.remove()
        assert fired and pool.allocator.open_requests == 0
        assert torch.equal(_generate(llama, ids, cache=cache, max_new_tokens=3), _generate(llama, ids, max_new_tokens=3))


@pytest.fixture(scope="module")
def qwen3_next():
    from _hf_hybrid_models import tiny
    return tiny("qwen3_next")  # layers: linear, full, linear, full attention


@pytest.mark.parametrize("before", [1, 2, 3])
def test_a_reset_before_each_layer_of_a_linear_attention_model_refuses_the_rest(qwen3_next, before):
    """Qwen3-Next (linear-attention layers 0 and 2): a reset before layer 1 (only the linear layer 0
    had taken the step) was not refused at all, and one before layer 2 let that linear layer open
    new rows before layer 3 was refused; either way rows were left open and the next generate gave
    other tokens than DynamicCache's. Now the first layer after the reset is refused, nothing open."""
    model = qwen3_next
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_context_len=64)
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(1))
    with KVPoolCache(pool) as cache:
        _generate(model, ids, cache=cache, max_new_tokens=3)
        fired = []

        def pre(module, args, kwargs):
            if not fired:
                fired.append(cache.reset())
        hook = model.model.layers[before].register_forward_pre_hook(pre, with_kwargs=True)
        try:
            with pytest.raises(IncompleteForwardError, match=rf"^layer {before}: the cache was reset \(or closed\) during this forward"):
                with torch.no_grad():
                    model(input_ids=torch.full((2, 1), 9), use_cache=True, **{CACHE_KW: cache})
        finally:
            hook.remove()
        assert fired and pool.allocator.open_requests == 0
        assert torch.equal(_generate(model, ids, cache=cache, max_new_tokens=3), _generate(model, ids, max_new_tokens=3))


@pytest.mark.parametrize("at", [0, 1, 2, 3])
def test_a_linear_attention_forward_cut_short_then_reset_then_generate(qwen3_next, at):
    """The documented way out (reset after a forward cut short) on a linear-attention model, cut in
    each layer: the note the reset leaves never refuses the next forward."""
    model = qwen3_next
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_context_len=64)
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(1))
    with KVPoolCache(pool) as cache:
        _generate(model, ids, cache=cache, max_new_tokens=2)
        hook = model.model.layers[at].register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(KeyError("cut")))
        with pytest.raises(KeyError), torch.no_grad():
            model(input_ids=torch.full((2, 1), 9), use_cache=True, **{CACHE_KW: cache})
        hook.remove()
        cache.reset()
        cache.reset()
        assert torch.equal(_generate(model, ids, cache=cache, max_new_tokens=3), _generate(model, ids, max_new_tokens=3))


def test_a_reset_after_a_forward_cut_short_then_a_new_forward_is_not_refused(llama):
    """The documented way out of a forward cut short (reset) leaves the next forward alone."""
    pool = pool_for_model(llama, max_tokens=256, page_size=4, max_context_len=64)
    ids = torch.randint(3, 90, (1, 5), generator=torch.Generator().manual_seed(2))
    with KVPoolCache(pool) as cache:
        _generate(llama, ids, cache=cache, max_new_tokens=2)
        hook = llama.model.layers[1].register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(KeyError("cut")))
        with pytest.raises(KeyError), torch.no_grad():
            llama(input_ids=torch.full((1, 1), 9), use_cache=True, **{CACHE_KW: cache})
        hook.remove()
        cache.reset()
        assert torch.equal(_generate(llama, ids, cache=cache, max_new_tokens=3), _generate(llama, ids, max_new_tokens=3))


def test_salt_may_be_one_per_row(llama):
    """docs/transformers.md: ``salt=`` is an int64 or one per row; each row's prompt is published
    and found under its own salt."""
    pool = pool_for_model(llama, max_tokens=512, page_size=4, max_context_len=64)
    prompt = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(3)).repeat(2, 1)
    with KVPoolCache(pool, prefix_ids=prompt, salt=torch.tensor([1, 2])) as cache:
        _generate(llama, prompt, cache=cache, max_new_tokens=1)
    # (each cache publishes its rows under their salts on close: every case asks with salts new but one)
    for salt, hits in [(torch.tensor([1, 3]), [8, 0]), (np.array([4, 2]), [0, 8]), (2, [8, 8]), (5, [0, 0])]:
        with KVPoolCache(pool, prefix_ids=prompt, salt=salt) as cache:
            assert cache.cached_lens.tolist() == hits
            assert torch.equal(_generate(llama, prompt, cache=cache, max_new_tokens=3),
                               _generate(llama, prompt, max_new_tokens=3))


@pytest.mark.parametrize("before", [1, 2], ids=["after-a-state-layer-alone", "before-a-state-layer"])
@pytest.mark.parametrize("call", ["reset", "close"])
def test_a_reset_between_two_layers_of_a_linear_attention_model_refuses_the_rest(call, before):
    """Qwen3-Next (layers: linear, full, linear, full). A reset from a hook before layer 1, when only
    the state layer 0 had run, went unnoticed: layer 1 opened new rows and the forward returned
    silently wrong logits. Before layer 2 (a state layer), layer 2 opened new rows and wrote their
    state before layer 3 was refused: the rows stayed open and the next generate gave wrong tokens.
    Now the first layer left behind is refused, nothing is opened, and the next generate is right."""
    model = tiny("qwen3_next")
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_requests=8)
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(1))
    ref = _generate(model, ids, max_new_tokens=3)
    with KVPoolCache(pool) as cache:
        _generate(model, ids, cache=cache, max_new_tokens=3)
        fired = []

        def pre(module, args, kwargs):
            if not fired:
                fired.append(getattr(cache, call)())
        hook = model.model.layers[before].register_forward_pre_hook(pre, with_kwargs=True)
        try:
            with pytest.raises(IncompleteForwardError, match=rf"layer {before}: the cache was reset \(or closed\)"):
                with torch.no_grad():
                    model(input_ids=torch.full((2, 1), 9), use_cache=True, **{CACHE_KW: cache})
        finally:
            hook.remove()
        assert fired and pool.allocator.open_requests == 0 and cache.get_seq_length() == 0
        assert torch.equal(_generate(model, ids, cache=cache, max_new_tokens=3), ref)
    assert pool.allocator.open_requests == 0
    pool.check()
