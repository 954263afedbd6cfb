"""Outside checks of ``KVPoolCache``'s fast paths (the short ``update``, layer buffers,
deferred decode steps, views kept across steps), driven through the public API only and
compared with transformers' ``DynamicCache`` (or a full forward over the token history).

Bounded: a 2-3 layer, hidden-64 Llama (float32, CPU, one intra-op thread), at most a few
dozen steps per case."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from _hf_models import CACHE_KW, PAD, left_padded, tiny_model  # noqa: I001  (skips without transformers)
from transformers import DynamicCache

from kvpool import IncompleteForwardError
from kvpool.integrations.transformers import KVPoolCache, pool_for_model

TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_model("llama", num_hidden_layers=3)
    torch.set_num_threads(threads)


def forward(model, cache, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, **{CACHE_KW: cache}).logits


def decode_against_dynamic(model, cache, prompt, steps, between=None):
    """Greedy steps on ``cache`` and on a DynamicCache fed the same tokens; ``between(s)`` runs
    after step s. Returns the largest logit difference."""
    dyn = DynamicCache(config=model.config)
    x, worst = prompt, 0.0
    for s in range(steps):
        got, want = forward(model, cache, x), forward(model, dyn, x)
        worst = max(worst, (got - want).abs().max().item())
        x = want[:, -1].argmax(-1, keepdim=True)
        if between is not None:
            between(s)
    return worst


def pool_rows(pool, handles, layer, n):
    """Rows' first ``n`` tokens of ``layer`` read through the pool, as ``[B, H, n, D]``."""
    rows = pool.rows(np.asarray(handles))
    out = []
    for r in rows:
        idx = torch.as_tensor(np.asarray(pool.req_to_token[int(r), :n]).astype(np.int64))
        k, v = pool.read(layer, idx)
        out.append((k.transpose(0, 1), v.transpose(0, 1)))
    return torch.stack([k for k, _ in out]), torch.stack([v for _, v in out])


# -- the rows' pages changed by the pool's own calls on the cache's handles ------------------

@pytest.mark.parametrize("layer_buffers", [True, False])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_row_forked_through_the_pool_keeps_reading_its_own_pages(model, batch, layer_buffers):
    """``pool.fork(cache.handles[i])`` shares the row's pages; the row's next extend into its
    shared, partly filled last page copies it on write, so the row's K/V move to a new page.
    The cache must read them there (it kept its own page table while its rows shared none)."""
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_context_len=64)
    prompt = torch.randint(3, 90, (batch, 6), generator=torch.Generator().manual_seed(0))
    forks = []
    with KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        def between(s):
            if s == 3:
                forks.append(pool.fork(int(cache.handles[0]), 1))
            if s == 10:  # the fork extends after the row did: the row made the copy
                pool.extend(forks[0], 3)
        assert decode_against_dynamic(model, cache, prompt, 24, between) <= TOL
        pool.allocator.check()
    pool.close(forks[0])
    assert pool.allocator.used_pages == 0
    pool.allocator.check()


@pytest.mark.parametrize("layer_buffers", [True, False])
@pytest.mark.parametrize("page_size", [1, 4])
def test_rows_swapped_out_and_back_in_read_what_they_held(model, page_size, layer_buffers):
    """``swap_out`` / ``swap_in`` of the cache's rows (the pool says every position then reads
    the K/V it held): the pages they come back on differ, as another request took the old ones."""
    pool = pool_for_model(model, max_tokens=256, page_size=page_size, max_context_len=64, host_pages=64)
    other = pool.open(1)
    prompt = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(1))
    with KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        def between(s):
            if s == 3:
                h = cache.handles
                pool.swap_out(h)
                pool.extend(other, 5 * page_size)  # takes the freed device pages
                pool.swap_in(h)
        assert decode_against_dynamic(model, cache, prompt, 24, between) <= TOL
    pool.close(other)
    assert pool.allocator.used_pages == 0
    pool.allocator.check()


def test_another_batchs_forks_on_the_pool_leave_a_cache_its_own_page_table(model):
    """Beam search on one cache forks its own rows; a greedy cache on the same pool keeps its
    page table (and its deferred steps): only forks and swaps naming its rows make it read the
    table from the allocator again."""
    pool = pool_for_model(model, max_tokens=512, page_size=4, max_context_len=64)
    ids, mask = left_padded([5, 8], seed=3)
    with KVPoolCache(pool) as greedy, KVPoolCache(pool) as beams:
        prompt = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(2))

        def between(s):
            if s == 2:
                kw = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=PAD, attention_mask=mask)
                ref = model.generate(ids, **kw)
                assert torch.equal(model.generate(ids, **kw, **{CACHE_KW: beams}), ref)
        assert decode_against_dynamic(model, greedy, prompt, 12, between) <= TOL
        assert greedy.requests.pages.private and beams.requests.pages is not None
    assert pool.allocator.used_pages == 0
    pool.allocator.check()


# -- generate's modes: token-exact against DynamicCache ------------------------------------

MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=0),
    "beam": dict(num_beams=3, do_sample=False),
    "beam_return_2": dict(num_beams=4, num_return_sequences=2, do_sample=False),
    "sample_return_3": dict(do_sample=True, num_return_sequences=3),
    "prompt_lookup": dict(prompt_lookup_num_tokens=3, do_sample=False),
    "one_token": dict(max_new_tokens=1, do_sample=False),
}


@pytest.mark.parametrize("layer_buffers", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", list(MODES))
def test_generate_modes_give_dynamic_caches_tokens(model, mode, page_size, layer_buffers):
    batch = 1 if mode == "prompt_lookup" else 3  # (transformers: assisted decoding takes one row)
    ids, mask = left_padded([7, 12, 3][:batch], seed=batch)
    kw = {"max_new_tokens": 12, "pad_token_id": PAD, "attention_mask": mask, **MODES[mode]}

    def run(cache=None):
        torch.manual_seed(1234)
        return model.generate(ids, **kw, **({} if cache is None else {CACHE_KW: cache}))

    pool = pool_for_model(model, max_tokens=2048, page_size=page_size, max_context_len=128)
    with KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        assert torch.equal(run(cache), run())
        pool.allocator.check()
    assert pool.allocator.used_pages == 0 and pool.allocator.open_requests == 0


# -- calls between two layers of a step -------------------------------------------------------

@pytest.mark.parametrize("call", ["flush", "handles", "get_seq_length"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("layer_buffers", [True, False])
def test_calls_between_layers_change_nothing_and_the_pool_holds_dynamic_caches_kv(model, call, page_size,
                                                                                 layer_buffers):
    """``flush`` / ``handles`` / ``get_seq_length`` from a hook before a middle layer, at every
    step (deferred decode steps, page boundaries, the prompt); afterwards the pool, read through
    the handles, holds what DynamicCache holds."""
    pool = pool_for_model(model, max_tokens=512, page_size=page_size, max_context_len=64)
    prompt = torch.randint(3, 90, (2, 5), generator=torch.Generator().manual_seed(5))
    dyn = DynamicCache(config=model.config)
    with KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        lengths = []

        def pre(module, args, kwargs):
            if kwargs.get("cache", kwargs.get("past_key_values")) is cache:  # (not DynamicCache's forwards)
                lengths.append(getattr(cache, call)() if call != "handles" else cache.handles)
        hook = model.model.layers[1].register_forward_pre_hook(pre, with_kwargs=True)
        x = prompt
        try:
            for _ in range(14):
                got, want = forward(model, cache, x), forward(model, dyn, x)
                assert (got - want).abs().max().item() <= TOL
                x = want[:, -1].argmax(-1, keepdim=True)
        finally:
            hook.remove()
        if call == "get_seq_length":  # layer 0 has stored the step: it counts it
            assert lengths == [5 + i for i in range(14)]
        assert len(lengths) == 14
        n = cache.get_seq_length()
        assert pool.allocator.lengths(cache.handles).tolist() == [n, n] == [dyn.get_seq_length()] * 2
        for layer in range(3):
            k, v = pool_rows(pool, cache.handles, layer, n)
            assert torch.allclose(k, dyn.layers[layer].keys, atol=1e-6)
            assert torch.allclose(v, dyn.layers[layer].values, atol=1e-6)
        pool.allocator.check()
    assert pool.allocator.used_pages == 0


@pytest.mark.parametrize("layer_buffers", [True, False])
def test_two_batches_on_one_pool_step_in_turn(model, layer_buffers):
    """Two caches' steps interleave on one pool, so neither batch's pages are consecutive."""
    pool = pool_for_model(model, max_tokens=512, page_size=4, max_context_len=64)
    xs = [torch.randint(3, 90, (b, 6), generator=torch.Generator().manual_seed(b)) for b in (1, 3)]
    dyns = [DynamicCache(config=model.config) for _ in xs]
    with KVPoolCache(pool, layer_buffers=layer_buffers) as a, KVPoolCache(pool, layer_buffers=layer_buffers) as b:
        for _ in range(18):
            for i, cache in enumerate((a, b)):
                got, want = forward(model, cache, xs[i]), forward(model, dyns[i], xs[i])
                assert (got - want).abs().max().item() <= TOL
                xs[i] = want[:, -1].argmax(-1, keepdim=True)
        pool.allocator.check()
    assert pool.allocator.used_pages == 0


# -- grad mode after steps the fast path took ---------------------------------------------

@pytest.mark.parametrize("layer_buffers", [True, False])
@pytest.mark.parametrize("page_size", [1, 4])
def test_grad_mode_steps_between_no_grad_steps_get_dynamic_caches_gradients(model, page_size, layer_buffers):
    """A prompt and steps under no_grad (the short update, deferred steps), steps under grad mode
    in between: the loss and every parameter's gradient are DynamicCache's with the earlier
    forwards' K/V held fixed (docs/transformers.md), and the pool stays out of autograd."""
    params = list(model.parameters())
    prompt = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(6))
    modes = [torch.no_grad, torch.enable_grad, torch.no_grad, torch.enable_grad, torch.enable_grad, torch.no_grad,
             torch.enable_grad]

    def run(cache):
        for p in params:
            p.requires_grad_(True)
            p.grad = None
        with torch.no_grad():
            model(input_ids=prompt, use_cache=True, **{CACHE_KW: cache})
        loss = 0
        for i, mode in enumerate(modes):
            with mode():
                logits = model(input_ids=(prompt[:, :1] + i) % 90 + 3, use_cache=True, **{CACHE_KW: cache}).logits
            if logits.requires_grad:
                loss = loss + (logits ** 2).mean() * (i + 1)
            if isinstance(cache, DynamicCache):
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys.detach(), layer.values.detach()
        loss.backward()
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.requires_grad_(False)
            p.grad = None
        return loss.detach(), grads

    want_loss, want = run(DynamicCache(config=model.config))
    pool = pool_for_model(model, max_tokens=256, page_size=page_size, max_context_len=64)
    with KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        got_loss, got = run(cache)
    assert abs(got_loss - want_loss) <= TOL
    assert max((a - b).abs().max().item() for a, b in zip(got, want)) <= TOL
    assert not any(t.requires_grad for _, t in pool.named_tensors())
    pool.allocator.check()


# -- random interleavings: forwards cut short, crops, reorders, selects, flushes --------------

class Cut(Exception):
    pass


def full_forward(model, history):
    """Logits and DynamicCache of one forward over every row's token history."""
    dyn = DynamicCache(config=model.config)
    return forward(model, dyn, torch.tensor(history)), dyn


@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings_match_a_full_forward(model, seed):
    """Each forward's logits equal a full forward over the rows' token history; a forward cut
    short in a layer (before its attention or its MLP) is refused by the next forward with the
    pool unchanged, then cropped; at checks the pool holds the history's K/V."""
    rng = random.Random(seed)
    page, layer_buffers, rows = rng.choice([1, 3, 4]), seed % 2 == 0, rng.choice([1, 2, 3])
    pool = pool_for_model(model, max_tokens=512, page_size=page, max_context_len=64)
    history: list[list[int]] = [[] for _ in range(rows)]
    unfinished = 0
    with KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        for _ in range(40):
            op = rng.choices(["step", "cut", "crop", "flush", "reorder", "select", "check"], [10, 3, 2, 1, 1, 1, 2])[0]
            n = len(history[0])
            if unfinished:
                kept = (pool.allocator.used_pages, pool.allocator.open_requests)
                with pytest.raises(IncompleteForwardError):
                    forward(model, cache, torch.full((len(history), 1), 5))
                assert (pool.allocator.used_pages, pool.allocator.open_requests) == kept
                cache.crop(-unfinished)
                unfinished = 0
                assert cache.get_seq_length() == n
                continue
            if op in ("step", "cut") and n < 50:
                t = rng.choice([1, 1, 1, 2, 5]) if n else rng.choice([1, 4, 7])
                new = [[rng.randrange(3, 90) for _ in range(t)] for _ in history]
                if op == "step":
                    got = forward(model, cache, torch.tensor(new))
                    history = [h + x for h, x in zip(history, new)]
                    want, _ = full_forward(model, history)
                    assert (got - want[:, -t:]).abs().max().item() <= TOL
                    continue
                layer, at_mlp = rng.randrange(3), rng.random() < 0.5
                where = model.model.layers[layer]

                def boom(*args):
                    raise Cut
                hook = where.mlp.register_forward_pre_hook(boom) if at_mlp else \
                    where.self_attn.register_forward_pre_hook(boom)
                with pytest.raises(Cut):
                    forward(model, cache, torch.tensor(new))
                hook.remove()
                if at_mlp and layer == 2:  # every layer stored the step: it stands
                    history = [h + x for h, x in zip(history, new)]
                else:
                    unfinished = cache.get_seq_length() - n
                    assert unfinished in (0, t)
                if rng.random() < 0.5:
                    cache.flush()
            elif op == "crop" and n:
                m = rng.randrange(1, n + 1)
                cache.crop(-m)
                history = [h[: n - m] for h in history]
            elif op == "flush":
                cache.flush()
            elif op in ("reorder", "select") and n:
                b = len(history)
                src = [rng.randrange(b) for _ in range(b)] if op == "reorder" else \
                    sorted(rng.sample(range(b), rng.randrange(1, b + 1)))
                (cache.reorder_cache if op == "reorder" else cache.batch_select_indices)(torch.tensor(src))
                history = [list(history[s]) for s in src]
            elif op == "check" and n:
                _, dyn = full_forward(model, history)
                assert pool.allocator.lengths(cache.handles).tolist() == [n] * len(history)
                for layer in range(3):
                    k, v = pool_rows(pool, cache.handles, layer, n)
                    assert torch.allclose(k, dyn.layers[layer].keys, atol=TOL)
                    assert torch.allclose(v, dyn.layers[layer].values, atol=TOL)
                pool.allocator.check()
    assert pool.allocator.used_pages == 0 and pool.allocator.open_requests == 0
    pool.allocator.check()
