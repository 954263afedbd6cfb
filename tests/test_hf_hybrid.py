"""KVPoolCache on hybrid pools: greedy tokens and logits equal transformers' default cache
on tiny random Gemma 3, GPT-OSS, Mistral (sliding_window) and Qwen3-Next (linear attention),
generating far past the window, with the pool holding at most W + one page per sliding layer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _hf_hybrid_models import MODELS, P, W, tiny
from _hf_models import CACHE_KW, VOCAB, greedy, left_padded

transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch
from transformers import DynamicCache

from kvpool.errors import TensorDeviceError, TensorDtypeError, TensorShapeError
from kvpool.integrations._hybrid import PoolStateLayer
from kvpool.integrations.transformers import KVPoolCache, pool_for_model

NEW = 24


def watch_windows(pool: Any, seen: list[int]) -> None:
    """After every single-token extend, record each request's held tokens in each sliding layer."""
    extend = pool.extend
    sliding = [layer for layer in range(pool.num_layers) if pool.group(layer).kind == "sliding"]

    def wrapped(handles: Any, counts: Any, tokens: Any = None) -> Any:
        out = extend(handles, counts, tokens)
        if int(np.max(counts)) == 1:
            seen.extend(pool.held_tokens(int(h), layer) for h in np.asarray(handles) for layer in sliding)
        return out

    pool.extend = wrapped


@pytest.mark.parametrize("arch", list(MODELS))
def test_greedy_tokens_and_logits_equal_the_default_cache(arch):
    model = tiny(arch)
    ids, mask = left_padded([12, 9], seed=3)
    ref = greedy(model, ids, mask, NEW, DynamicCache(config=model.config))
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=4)
    kinds = {g.kind for g in pool.groups}
    assert kinds == {"gemma3": {"sliding", "full"}, "gpt_oss": {"sliding", "full"}, "mistral": {"sliding"},
                     "qwen3_next": {"state", "full"}}[arch]
    held: list[int] = []
    watch_windows(pool, held)
    with KVPoolCache(pool) as cache:
        out = greedy(model, ids, mask, NEW, cache)
        assert cache.requests.length == ids.shape[1] + NEW - 1 > 3 * W
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    if "sliding" in kinds:
        assert len(held) == 2 * sum(pool.group(i).kind == "sliding" for i in range(4)) * (NEW - 1)
        assert max(held) <= W + P  # the window plus one page, per sliding layer per request
    assert pool.open_requests == 0
    pool.check()


def test_linear_attention_state_in_scattered_slots_is_written_back():
    """Rows whose state slots are not consecutive get working copies; they must reach the pool."""
    model = tiny("qwen3_next")
    ids, mask = left_padded([10, 7], seed=5)
    ref = greedy(model, ids, mask, 12, DynamicCache(config=model.config))
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=4)
    first = pool.open(3)
    pool.close(first[1:2])  # the next two requests get slots 2 and 4
    with KVPoolCache(pool) as cache:
        out = greedy(model, ids, mask, 12, cache)
        states = [x for x in cache.layers if isinstance(x, PoolStateLayer)]
        assert states and not any(x._consecutive for x in states)
        last = states[0].recurrent_states[0].clone()
        cache.requests.flush()
        slots = pool.state_slots(cache.handles, 0)
        assert torch.equal(pool.state(0, "recurrent")[slots], last)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_sampling_several_sequences_forks_window_and_state():
    """num_return_sequences expands the rows after the prompt: forks share pages and copy state."""
    for arch in ("gemma3", "qwen3_next"):
        model = tiny(arch)
        ids, mask = left_padded([9], seed=7)
        kw = dict(num_beams=2, num_return_sequences=2, early_stopping=False)
        ref = greedy(model, ids, mask, 14, DynamicCache(config=model.config), **kw)
        pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=8)
        with KVPoolCache(pool) as cache:
            out = greedy(model, ids, mask, 14, cache, **kw)
        assert torch.equal(out.sequences, ref.sequences), arch
        pool.check()
        assert pool.open_requests == 0


def test_kv_of_the_wrong_geometry_is_a_typed_error():
    model = tiny("gemma3")
    pool = pool_for_model(model, max_tokens=64, page_size=P, max_requests=2)
    with KVPoolCache(pool) as cache:
        k = torch.zeros(1, 3, 2, 16)
        with pytest.raises(TensorShapeError, match="kv_heads|\\[batch, 2"):
            cache.update(k, k, 0)
        assert pool.open_requests == 0


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_kv_of_the_wrong_dtype_or_device_gets_the_plain_caches_error_class(arch):
    """An engine's `except TensorDtypeError` (a model/pool dtype mismatch) must catch it on a
    sliding-window model too: the hybrid cache raised TensorShapeError for both."""
    model = tiny(arch)
    pool = pool_for_model(model, max_tokens=64, page_size=P, max_requests=2)
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    with KVPoolCache(pool) as cache:
        for k, err, match in ((torch.zeros(1, heads, 2, dim, dtype=torch.float64), TensorDtypeError, "float64"),
                              (torch.zeros(1, heads, 2, dim, device="meta"), TensorDeviceError, "meta")):
            with pytest.raises(err, match=match):
                cache.update(k, k, 0)
            assert pool.open_requests == 0
        pool.check()


def test_pool_for_model_builds_the_plain_pool_when_no_window_slides():
    from kvpool import KVPool
    from kvpool.hybrid import HybridKVPool

    model = tiny("mistral")
    assert isinstance(pool_for_model(model, max_tokens=64, page_size=P), HybridKVPool)
    # A window as long as the longest request never slides: every layer is full.
    plain = pool_for_model(model, max_tokens=64, page_size=P, max_context_len=W)
    assert type(plain) is KVPool
    gemma = pool_for_model(tiny("gemma3"), max_tokens=64, page_size=P)
    assert gemma.layer_types == ("sliding_attention",) * 3 + ("full_attention",) and gemma.sliding_window == W
    qwen = pool_for_model(tiny("qwen3_next"), max_tokens=64, page_size=P)
    assert qwen.state_shapes == {"conv": ((64, 4), torch.float32), "recurrent": ((4, 8, 8), torch.float32)}


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_parity_under_grad_modes_with_a_pool_built_inside_them(mode):
    ctx = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}[mode]
    for arch in ("gemma3", "qwen3_next"):
        model = tiny(arch)
        ids, mask = left_padded([11], seed=9)
        ref = greedy(model, ids, mask, 14, DynamicCache(config=model.config))
        with ctx():
            pool = pool_for_model(model, max_tokens=128, page_size=P, max_requests=2)
            with KVPoolCache(pool) as cache:
                out = greedy(model, ids, mask, 14, cache)
        assert torch.equal(out.sequences, ref.sequences), arch
        for name, t in pool.named_tensors():
            assert not t.is_inference() and not t.requires_grad, name


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_next"])
def test_prefix_hits_across_groups_give_identical_outputs_and_compute_only_new_tokens(arch):
    """A prompt extending a cached 16-token one reuses its full pages, the sliding window
    before the hit and the linear-attention state checkpoint at 16 (taken once the step
    that ended there has run: a prefill that runs past a page boundary leaves none
    there); outputs equal the default cache's."""
    model = tiny(arch)
    g = torch.Generator().manual_seed(13)
    shared = torch.randint(3, VOCAB, (16,), generator=g)
    prompts = [torch.cat([shared, torch.randint(3, VOCAB, (n,), generator=g)])[None] for n in (0, 6)]
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=4)
    fed: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: fed.append(i[0].shape[1]))
    try:
        for i, p in enumerate(prompts):
            ref = greedy(model, p, None, 12, DynamicCache(config=model.config))
            fed.clear()
            with KVPoolCache(pool, prefix_ids=p) as cache:
                out = greedy(model, p, None, 12, cache)
                hit = int(cache.cached_lens[0])
            assert hit == (0 if i == 0 else 16)
            assert fed[0] == p.shape[1] - hit  # the prefill computed only the uncached tokens
            assert torch.equal(out.sequences, ref.sequences)
            for a, b in zip(out.logits, ref.logits):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    finally:
        hook.remove()
    pool.check()


@pytest.mark.parametrize("kw", [dict(num_beams=2, num_return_sequences=2, early_stopping=False),
                                dict(do_sample=True, num_return_sequences=2)], ids=["beams", "samples"])
def test_a_prefix_hit_expanded_by_generate_on_a_model_whose_first_layer_keeps_state(kw):
    """generate expands rows opened on prefix_ids (repeat_interleave) for beam search and
    num_return_sequences. Qwen3-Next's first layer is linear attention: its state update came
    before any attention layer could take the expansion, and torch raised a size mismatch."""
    model = tiny("qwen3_next")
    g = torch.Generator().manual_seed(17)
    shared = torch.randint(3, VOCAB, (16,), generator=g)
    first, longer = shared[None], torch.cat([shared, torch.randint(3, VOCAB, (5,), generator=g)])[None]
    pool = pool_for_model(model, max_tokens=512, page_size=P, max_requests=8)
    with KVPoolCache(pool, prefix_ids=first) as cache:
        greedy(model, first, None, 2, cache)
    torch.manual_seed(0)
    ref = greedy(model, longer, None, 8, DynamicCache(config=model.config), **kw)
    with KVPoolCache(pool, prefix_ids=longer) as cache:
        assert int(cache.cached_lens[0]) == 16
        torch.manual_seed(0)
        out = greedy(model, longer, None, 8, cache, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    pool.check()
    assert pool.open_requests == 0


def test_crop_without_a_state_checkpoint_is_refused_and_changes_nothing():
    from kvpool._core import RollbackUnavailableError

    model = tiny("qwen3_next")
    ids, mask = left_padded([7], seed=2)
    pool = pool_for_model(model, max_tokens=128, page_size=P, max_requests=2)
    with KVPoolCache(pool) as cache:
        greedy(model, ids, mask, 4, cache)
        n, h = cache.requests.length, cache.handles
        state = pool.state(0, "recurrent")[pool.state_slots(h, 0)].clone()
        with pytest.raises(RollbackUnavailableError, match="checkpoint"):
            cache.crop(-2)
        assert cache.requests.length == n == pool.length(int(h[0])) and cache.get_seq_length() == n
        assert torch.equal(pool.state(0, "recurrent")[pool.state_slots(h, 0)], state)
    pool.check()


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_closed_cache_serves_a_new_batch_of_a_linear_attention_model(how):
    """close() / reset() say the cache can serve a new batch; on a model whose first layer is
    linear attention the state layer is the first to see it, so it must open the rows again."""
    model = tiny("qwen3_next")
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=8)
    first_ids, first_mask = left_padded([6, 9], seed=11)
    ids, mask = left_padded([8, 5, 7], seed=12)
    ref = greedy(model, ids, mask, 6, DynamicCache(config=model.config))
    cache = KVPoolCache(pool)
    greedy(model, first_ids, first_mask, 4, cache)
    getattr(cache, how)()
    assert pool.open_requests == 0
    out = greedy(model, ids, mask, 6, cache)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    cache.close()
    assert pool.open_requests == 0
    pool.check()


@pytest.mark.parametrize("arch", ["qwen3_next", "gemma3"])
def test_a_first_forward_that_does_not_fit_leaves_the_pool_as_it_was(arch):
    """The rows opened by the first forward (by its first linear-attention layer, which
    writes their state before any attention layer extends them) are closed again when
    the prompt does not fit; the same cache then serves the batch once there is room."""
    from kvpool import PoolExhaustedError

    model = tiny(arch)
    ids, mask = left_padded([12, 9], seed=4)
    pool = pool_for_model(model, max_tokens=32, page_size=P, max_requests=4)
    blocker = pool.open(1)
    pool.extend(blocker, 24)  # 2 rows of 12 no longer fit
    a = pool.allocator

    def counters():
        return (a.open_requests, [a.used_pages(g) for g in range(a.num_groups)],
                [a.free_pages(g) for g in range(a.num_groups)], a.admissible_tokens())

    before = counters()
    cache = KVPoolCache(pool)
    with pytest.raises(PoolExhaustedError):
        greedy(model, ids, mask, 3, cache)
    assert counters() == before
    assert cache.handles is None
    pool.check()
    pool.close(blocker)
    ref = greedy(model, ids, mask, 3, DynamicCache(config=model.config))
    out = greedy(model, ids, mask, 3, cache)
    assert torch.equal(out.sequences, ref.sequences)
    cache.close()
    assert pool.open_requests == 0
    pool.check()


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_next"])
def test_a_prompt_cut_short_publishes_neither_pages_nor_state(arch):
    """A prefill that stops in layer 2 (after the first attention layer extended the rows)
    must not leave its pages, window or state checkpoint in the prefix cache: a longer
    prompt that starts with it then gets no hit, and the default cache's outputs."""
    model = tiny(arch)
    g = torch.Generator().manual_seed(21)
    first = torch.randint(3, VOCAB, (1, 16), generator=g)
    longer = torch.cat([first, torch.randint(3, VOCAB, (1, 6), generator=g)], 1)
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=4)
    ref = greedy(model, longer, None, 5, DynamicCache(config=model.config))

    def boom(module, args, kwargs):
        raise KeyboardInterrupt

    hook = model.model.layers[2].register_forward_pre_hook(boom, with_kwargs=True)
    try:
        with pytest.raises(KeyboardInterrupt), KVPoolCache(pool, prefix_ids=first) as cache:
            greedy(model, first, None, 5, cache)
    finally:
        hook.remove()
    with KVPoolCache(pool, prefix_ids=longer) as cache:
        out = greedy(model, longer, None, 5, cache)
        assert int(cache.cached_lens[0]) == 0
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    pool.check()


def test_a_retry_after_a_prefill_cut_short_publishes_no_checkpoint():
    """Qwen3-Next's first layer is linear attention, which publishes the rows' prompt pages
    and state (a checkpoint) at the start of each forward, before any attention layer runs.
    After a prefill cut short, the next forward must not publish them: it is refused, and
    nothing of the prompt reaches the prefix cache."""
    from kvpool import IncompleteForwardError

    model = tiny("qwen3_next")
    g = torch.Generator().manual_seed(23)
    prompt = torch.randint(3, VOCAB, (1, 16), generator=g)
    longer = torch.cat([prompt, torch.randint(3, VOCAB, (1, 6), generator=g)], 1)
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=4)
    ref = greedy(model, longer, None, 4, DynamicCache(config=model.config))

    def boom(module, args, kwargs):
        raise KeyboardInterrupt

    with torch.no_grad(), KVPoolCache(pool, prefix_ids=prompt) as cache:
        hook = model.model.layers[2].register_forward_pre_hook(boom, with_kwargs=True)
        try:
            with pytest.raises(KeyboardInterrupt):
                model(input_ids=prompt, **{CACHE_KW: cache})
        finally:
            hook.remove()
        with pytest.raises(IncompleteForwardError):
            model(input_ids=prompt, **{CACHE_KW: cache})
    with KVPoolCache(pool, prefix_ids=longer) as cache:
        out = greedy(model, longer, None, 4, cache)
        assert int(cache.cached_lens[0]) == 0
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    pool.check()


@pytest.mark.parametrize("cut", [1, 3], ids=["before-attention", "last-layer"])
def test_a_linear_attention_state_that_a_cut_short_forward_moved_is_not_used_again(cut):
    """Qwen3-Next's linear-attention layers update their state in place. A forward cut short
    before the first attention layer (layer 0's state already took the step) or in the
    last layer (layer 2's state took it, layer 3 never stored it) leaves states that no
    longer match the rows' length: the next forward and a reorder are refused
    (IncompleteForwardError, nothing changed) instead of computing from them, and a crop
    to a length the pool holds a state checkpoint for puts everything back."""
    from kvpool import IncompleteForwardError

    model = tiny("qwen3_next")
    ids = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(5))
    more = torch.tensor([[9]])
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=4)
    dyn = DynamicCache(config=model.config)

    def boom(module, args, kwargs):
        raise KeyboardInterrupt

    with torch.no_grad(), KVPoolCache(pool, prefix_ids=ids) as cache:
        for c in (dyn, cache):
            model(input_ids=ids[:, :12], **{CACHE_KW: c})
        model(input_ids=ids[:, 12:], **{CACHE_KW: cache})  # publishes a checkpoint at 12 on the way
        hook = model.model.layers[cut].register_forward_pre_hook(boom, with_kwargs=True)
        try:
            with pytest.raises(KeyboardInterrupt):
                model(input_ids=more, **{CACHE_KW: cache})
        finally:
            hook.remove()
        slots = pool.state_slots(cache.handles, 0)
        state = pool.state(0, "recurrent")[slots].clone()
        with pytest.raises(IncompleteForwardError, match="linear-attention|cut short"):
            model(input_ids=more, **{CACHE_KW: cache})
        assert torch.equal(pool.state(0, "recurrent")[slots], state)
        with pytest.raises(IncompleteForwardError):
            cache.reorder_cache(torch.tensor([0]))
        cache.crop(-(cache.get_seq_length() - 12))  # back to the checkpoint at 12
        for x in (ids[:, 12:], more, torch.tensor([[4]])):
            a = model(input_ids=x, **{CACHE_KW: dyn}).logits
            b = model(input_ids=x, **{CACHE_KW: cache}).logits
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    pool.check()


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]], ids=["plain", "hybrid"])
def test_a_step_past_the_context_length_names_the_batch_and_leaves_no_request_open(layer_types):
    # The pool's own refusal names an internal request handle, which a transformers user never saw.
    from kvpool import ContextTooLongError, KVPool
    kw = dict(layer_types=layer_types, sliding_window=8) if layer_types else {}
    pool = KVPool(2, 2, 8, dtype=torch.float32, page_size=4, num_pages=32, max_requests=4, max_context_len=12, **kw)
    k = torch.randn(2, 2, 13, 8)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        with pytest.raises(ContextTooLongError, match=r"rows to 13 tokens \(0 cached \+ 13 new\), more than the "
                                                      r"pool's max_context_len=12"):
            cache.update(k, k, 0)
        assert pool.allocator.open_requests == 0 and cache.get_seq_length() == 0
        cache.update(k[:, :, :12], k[:, :, :12], 0)  # up to the limit is taken
        assert cache.get_seq_length() == 12
