"""Training through a ``KVPoolCache`` when only the queries require grad (frozen k/v
projections: LoRA on q_proj alone, or a frozen model whose last layers are tuned).

Attention saves the K/V that ``update`` returns for its backward. Under grad mode those must
be tensors the cache never writes again: a later layer of the same forward, or a later step,
stores into the cache's layer buffers, staging buffer and pool, and autograd refuses a backward
through a saved tensor modified in place. Under ``no_grad`` and ``inference_mode`` nothing is
saved, so ``update`` keeps handing out the cache's own memory, copying nothing.
"""

from __future__ import annotations

import pytest
import torch
from _hf_models import CACHE_KW, left_padded, tiny_model  # noqa: I001  (skips without transformers)
from transformers import DynamicCache

from kvpool import KVPool
from kvpool.integrations.transformers import KVPoolCache, pool_for_model


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def detach_past(cache: DynamicCache) -> None:
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.detach(), layer.values.detach()


def trainable(model, which: str):
    """``q_last``: the last layer's q_proj alone, so no layer's K/V require grad; ``q``: every
    q_proj (k_proj/v_proj frozen: the first layer's K/V do not require grad, later layers'
    do through their hidden states); ``k``: every k_proj (the first layer's keys require grad,
    its values do not); ``all``: every weight."""
    model.requires_grad_(which == "all")
    if which == "q_last":
        model.model.layers[-1].self_attn.q_proj.requires_grad_(True)
    elif which in ("q", "k"):
        for layer in model.model.layers:
            getattr(layer.self_attn, f"{which}_proj").requires_grad_(True)
    return model


def gemma3():
    """Sliding layers with a window shorter than the prompt: a hybrid pool."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=4, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention"])
    with torch.inference_mode(False), torch.no_grad():
        torch.manual_seed(0)
        return transformers.Gemma3ForCausalLM(config).eval()


def train_steps(model, cache, steps, *, hold_past: bool):
    """One loss over every step's logits, one backward through all of them (as training with a
    cache does). ``hold_past``: the reference cache's earlier K/V become constants after each
    step, as the pool's are (only matters where K/V require grad)."""
    model.zero_grad(set_to_none=True)
    loss, logits = 0, []
    with torch.enable_grad():
        for x, m in steps:
            out = model(input_ids=x, attention_mask=m, **{CACHE_KW: cache}).logits
            loss = loss + out.square().mean()
            logits.append(out.detach())
            if hold_past and isinstance(cache, DynamicCache):
                detach_past(cache)
        loss.backward()
    return loss.detach(), logits, grads(model)


def prompt_then_tokens(lengths=(7, 4, 9), seed=2):
    """A left-padded prompt, then two decode steps."""
    ids, mask = left_padded(list(lengths), seed=seed)
    steps = [(ids, mask)]
    for x in torch.randint(3, 90, (2, ids.shape[0], 1), generator=torch.Generator().manual_seed(1)):
        mask = torch.cat([mask, torch.ones_like(x)], 1)
        steps.append((x, mask))
    return steps


def assert_same(ref, got):
    (ref_loss, ref_logits, ref_grads), (loss, logits, g) = ref, got
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(ref_logits, logits):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert g.keys() == ref_grads.keys() and g, sorted(set(ref_grads) ^ set(g))
    for name in ref_grads:
        torch.testing.assert_close(g[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


POOLS = {  # name: (pool_for_model kwargs, KVPoolCache kwargs, prompt lengths)
    "layer-buffers": (dict(page_size=16), dict(), (7, 4, 9)),
    "layer-buffers-page-1": (dict(page_size=1), dict(), (7, 4, 9)),
    "layer-buffers-paged": (dict(page_size=4, layout="paged"), dict(), (7, 4, 9)),
    "staging": (dict(page_size=16), dict(layer_buffers=False), (7, 4, 9)),
    "staging-paged": (dict(page_size=4, layout="paged"), dict(layer_buffers=False), (7, 4, 9)),
    "pool-views": (dict(page_size=4), dict(layer_buffers=False), (6,)),  # one row on consecutive pages
    "pool-views-paged": (dict(page_size=4, layout="paged"), dict(layer_buffers=False), (6,)),
}


@pytest.mark.parametrize("which", ["q_last", "q", "k", "all"])
@pytest.mark.parametrize("kind", sorted(POOLS))
def test_a_prompt_and_decode_steps_backpropagate_as_with_the_default_cache(kind, which):
    model = trainable(tiny_model("llama"), which)
    pool_kw, cache_kw, lengths = POOLS[kind]
    steps = prompt_then_tokens(lengths)
    pool = pool_for_model(model, max_tokens=256, max_context_len=32, **pool_kw)
    ref = train_steps(model, DynamicCache(config=model.config), steps, hold_past=which != "q_last")
    with KVPoolCache(pool, **cache_kw) as cache:
        got = train_steps(model, cache, steps, hold_past=False)
    assert_same(ref, got)
    assert not any(t.requires_grad for _, t in pool.named_tensors())
    pool.allocator.check()


@pytest.mark.parametrize("which", ["q_last", "q"])
def test_rows_opened_on_a_cached_prefix_backpropagate_as_with_the_default_cache(which):
    """``prefix_ids=``: the rows share the cached prompt pages; the forward computes only the
    rest of the prompt, whose reference runs the hit under no_grad first."""
    model = trainable(tiny_model("llama"), which)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 90, (2, 10), generator=g)
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_context_len=32)
    with torch.no_grad(), KVPoolCache(pool, prefix_ids=prompt) as cache:
        model(input_ids=prompt, **{CACHE_KW: cache})
    more = torch.randint(3, 90, (2, 2), generator=g)
    with KVPoolCache(pool, prefix_ids=prompt) as cache:
        hit = cache.get_seq_length()
        assert 0 < hit < prompt.shape[1]
        steps = [(prompt[:, hit:], torch.ones(2, prompt.shape[1], dtype=torch.long))]
        steps += [(more[:, i:i + 1], torch.ones(2, prompt.shape[1] + i + 1, dtype=torch.long)) for i in range(2)]
        got = train_steps(model, cache, steps, hold_past=False)
    ref_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt[:, :hit], **{CACHE_KW: ref_cache})
    ref = train_steps(model, ref_cache, steps, hold_past=which != "q_last")
    assert_same(ref, got)
    pool.allocator.check()


@pytest.mark.parametrize("which", ["q_last", "q"])
def test_a_hybrid_pool_backpropagates_as_with_the_default_cache(which):
    """Its attention layers gather the rows' K/V into new tensors at every update."""
    model = trainable(gemma3(), which)
    steps = prompt_then_tokens((7, 4, 9))
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_context_len=32)
    ref = train_steps(model, DynamicCache(config=model.config), steps, hold_past=which != "q_last")
    with KVPoolCache(pool) as cache:
        got = train_steps(model, cache, steps, hold_past=False)
    assert_same(ref, got)
    pool.allocator.check()


# -- update itself ----------------------------------------------------------------------
H, D, LAYERS = 2, 8, 3


def small_pool(layout: str = "token") -> KVPool:
    """``layout`` "fp8": an fp8 token-layout pool, read back dequantized into new tensors."""
    fp8 = layout == "fp8"
    return KVPool(LAYERS, H, D, dtype=torch.float8_e4m3fn if fp8 else torch.float32, page_size=4, num_slots=256,
                  max_requests=4, max_context_len=64, layout="token" if fp8 else layout,
                  compute_dtype=torch.float32 if fp8 else None)


def cache_storages(cache: KVPoolCache) -> set[int]:
    """Storage addresses of what the cache writes: the pool's caches and its own buffers."""
    pool, pages = cache.pool, cache.requests.pages
    held = [t for _, t in pool.named_tensors()]
    if pages is not None:
        held += [x for x in (pages._stage, pages._buf) if x is not None]
    return {t.untyped_storage().data_ptr() for t in held}


UPDATE_CASES = [(1, True, "token"), (3, True, "token"), (3, False, "token"), (1, False, "token"),
                (1, False, "paged"), (3, True, "paged")]


@pytest.mark.parametrize(("batch", "layer_buffers", "layout"), UPDATE_CASES + [(3, True, "fp8")])
def test_what_update_returns_under_grad_mode_is_never_written_by_later_updates(batch, layer_buffers, layout):
    """K/V that do not require grad (frozen projections), under grad mode: every layer of
    every step, including the steps that take the short way, and decode steps past a page."""
    pool = small_pool(layout)
    g = torch.Generator().manual_seed(batch)
    got: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]] = []
    seen: dict[int, list[torch.Tensor]] = {layer: [] for layer in range(LAYERS)}
    with torch.enable_grad(), KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        for t in [5] + [1] * 6:
            for layer in range(LAYERS):
                k = torch.randn(batch, H, t, D, generator=g)
                seen[layer].append(k)
                out_k, out_v = cache.update(k, -k, layer)
                want = torch.cat(seen[layer], 2)
                if layout == "fp8":
                    want = want.to(torch.float8_e4m3fn).float()  # (scale 1)
                assert torch.equal(out_k, want) and torch.equal(out_v, -want)
                got.append((out_k, out_v, out_k._version + out_v._version, want))
        storages = cache_storages(cache)
    for out_k, out_v, version, want in got:
        assert out_k._version + out_v._version == version
        assert torch.equal(out_k, want) and torch.equal(out_v, -want)
        assert out_k.untyped_storage().data_ptr() not in storages
    pool.allocator.check()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize(("batch", "layer_buffers", "layout"), UPDATE_CASES)
def test_outside_grad_mode_update_hands_out_the_caches_own_memory(mode, batch, layer_buffers, layout):
    """Nothing is saved for a backward there, so nothing is copied for one either."""
    pool = small_pool(layout)
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    g = torch.Generator().manual_seed(batch)
    with ctx, KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        for t in [5] + [1] * 6:
            for layer in range(LAYERS):
                k = torch.randn(batch, H, t, D, generator=g)
                out_k, out_v = cache.update(k, -k, layer)
                storages = cache_storages(cache)
                assert out_k.untyped_storage().data_ptr() in storages
                assert out_v.untyped_storage().data_ptr() in storages
    pool.allocator.check()


def test_a_cache_moving_between_grad_modes_copies_only_under_grad_mode():
    """Scoring under grad mode between no_grad steps of the same cache (and back)."""
    pool = small_pool()
    g = torch.Generator().manual_seed(0)
    seen: dict[int, list[torch.Tensor]] = {layer: [] for layer in range(LAYERS)}
    with KVPoolCache(pool) as cache:
        for t, grad in [(5, False), (1, False), (1, True), (1, True), (1, False), (2, True), (1, False)]:
            with torch.set_grad_enabled(grad):
                for layer in range(LAYERS):
                    k = torch.randn(1, H, t, D, generator=g)
                    seen[layer].append(k)
                    out_k, out_v = cache.update(k, -k, layer)
                    want = torch.cat(seen[layer], 2)
                    assert torch.equal(out_k, want) and torch.equal(out_v, -want)
                    owned = out_k.untyped_storage().data_ptr() not in cache_storages(cache)
                    assert owned == grad, (t, grad, layer)
    pool.allocator.check()
