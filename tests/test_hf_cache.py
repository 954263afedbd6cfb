"""KVPoolCache against transformers' own generate with its default cache (CPU, float32).

Greedy decoding must give the same tokens and logits within 1e-4 at every step, for
several architectures, batch sizes, prompt lengths (left padding) and page sizes,
under every grad mode; and the pool must be left with every page free.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from _hf_models import CACHE_KW, greedy, left_padded, tiny_model  # noqa: I001  (skips without transformers)
from transformers import DynamicCache

import kvpool
from kvpool import KVPool, PoolExhaustedError, TensorDtypeError, TensorShapeError
from kvpool.integrations.transformers import KVPoolCache, pool_for_model

NEW_TOKENS = 32
TOL = 1e-4
BATCHES = {1: [9], 4: [5, 12, 8, 3]}


def _modes(name: str) -> contextlib.AbstractContextManager[object]:
    return {"inference": torch.inference_mode(), "no_grad": torch.no_grad(),
            "none": contextlib.nullcontext()}[name]


def assert_same_generation(ref, out) -> None:
    assert torch.equal(ref.sequences, out.sequences), (ref.sequences, out.sequences)
    assert len(ref.logits) == len(out.logits) == NEW_TOKENS
    for step, (a, b) in enumerate(zip(ref.logits, out.logits)):
        diff = (a - b).abs().max().item()
        assert diff <= TOL, f"step {step}: logits differ by {diff}"


@pytest.fixture(scope="module")
def models():
    # One intra-op thread: these matmuls are tiny, and CI's 2 cores are shared.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {arch: tiny_model(arch) for arch in ("llama", "qwen2", "mistral")}
    torch.set_num_threads(threads)



@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_parity_with_dynamic_cache(models, arch, batch, page_size):
    model = models[arch]
    ids, mask = left_padded(BATCHES[batch], seed=batch)
    ref = greedy(model, ids, mask, NEW_TOKENS)
    pool = pool_for_model(model, max_tokens=1024, page_size=page_size, max_context_len=128)
    with KVPoolCache(pool) as cache:
        out = greedy(model, ids, mask, NEW_TOKENS, cache=cache)
        # Every row holds the padded prompt plus every fed-back token.
        lengths = pool.allocator.lengths(cache.handles)
        assert lengths.tolist() == [ids.shape[1] + NEW_TOKENS - 1] * batch
        assert cache.get_seq_length() == ids.shape[1] + NEW_TOKENS - 1
    assert_same_generation(ref, out)
    assert pool.allocator.used_pages == 0 and pool.allocator.open_requests == 0
    pool.allocator.check()


@pytest.mark.parametrize("mode", ["inference", "no_grad", "none"])
def test_grad_modes_pool_built_inside_the_mode(models, mode):
    """The pool may be built under any mode; generate under any mode gives the same result."""
    model = models["llama"]
    ids, mask = left_padded(BATCHES[4], seed=7)
    ref = greedy(model, ids, mask, NEW_TOKENS)
    with _modes(mode):
        pool = pool_for_model(model, max_tokens=512, page_size=16, max_context_len=64)
        assert not any(t.is_inference() for _, t in pool.named_tensors())
        with KVPoolCache(pool) as cache:
            out = greedy(model, ids, mask, NEW_TOKENS, cache=cache)
    assert_same_generation(ref, out)
    assert kvpool.audit(pool) == []
    # Reused outside the mode it was built in: in-place writes still work.
    with KVPoolCache(pool) as cache:
        again = greedy(model, ids, mask, NEW_TOKENS, cache=cache)
    assert torch.equal(again.sequences, ref.sequences)


def test_forward_then_crop_matches_dynamic_cache(models):
    model = models["llama"]
    ids, mask = left_padded([10, 6, 14], seed=3)
    pool = pool_for_model(model, max_tokens=256, page_size=16, max_context_len=64)
    dyn = DynamicCache(config=model.config)
    with torch.no_grad(), KVPoolCache(pool) as cache:
        for c in (dyn, cache):
            model(input_ids=ids, attention_mask=mask, **{CACHE_KW: c})
            c.crop(-4)  # forget the last 4 prompt tokens, then feed them again
        assert cache.get_seq_length() == dyn.get_seq_length() == ids.shape[1] - 4
        assert pool.allocator.lengths(cache.handles).tolist() == [ids.shape[1] - 4] * 3
        a = model(input_ids=ids[:, -4:], attention_mask=mask, **{CACHE_KW: dyn}).logits
        b = model(input_ids=ids[:, -4:], attention_mask=mask, **{CACHE_KW: cache}).logits
        assert (a - b).abs().max().item() <= TOL
        with pytest.raises(ValueError, match="negative"):
            cache.crop(3)
    pool.allocator.check()


def test_permutation_and_select_need_no_fork(models):
    """Reordering without duplicates only moves handles: no shared pages needed."""
    model = models["llama"]
    ids, mask = left_padded([7, 11, 4], seed=5)
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_context_len=64)
    dyn = DynamicCache(config=model.config)
    with torch.no_grad(), KVPoolCache(pool) as cache:
        for c in (dyn, cache):
            model(input_ids=ids, attention_mask=mask, **{CACHE_KW: c})
            c.reorder_cache(torch.tensor([2, 0, 1]))
            c.batch_select_indices(torch.tensor([True, False, True]))
        order = torch.tensor([2, 1])  # rows 2,0,1 -> keep rows 0 and 2 of that = original 2, 1
        nxt = torch.randint(3, 50, (2, 1))
        m2 = torch.cat([mask[order], torch.ones(2, 1, dtype=mask.dtype)], 1)
        a = model(input_ids=nxt, attention_mask=m2, **{CACHE_KW: dyn}).logits
        b = model(input_ids=nxt, attention_mask=m2, **{CACHE_KW: cache}).logits
        assert (a - b).abs().max().item() <= TOL
        assert pool.allocator.open_requests == 2  # the dropped row was closed
    pool.allocator.check()


class _PoolWithout:
    """A KVPool seen through a proxy that lacks some calls: an engine's own
    pool-like object without shared pages, which KVPoolCache duck-types."""

    def __init__(self, pool, *missing):
        self._pool, self._missing = pool, missing

    def __getattr__(self, name):
        if name in self._missing:
            raise AttributeError(name)
        return getattr(self._pool, name)


def test_beam_search_without_fork_says_it_needs_shared_pages(models):
    model = models["llama"]
    ids, mask = left_padded([6, 9], seed=1)
    pool = pool_for_model(model, max_tokens=512, page_size=16, max_context_len=64)
    with KVPoolCache(_PoolWithout(pool, "fork")) as cache:
        with pytest.raises(NotImplementedError, match="shared pages"):
            greedy(model, ids, mask, 8, cache=cache, num_beams=3)
    assert pool.allocator.used_pages == 0
    pool.allocator.check()


class CopyForkPool(KVPool):
    """A KVPool whose fork copies instead of sharing (only public API): lets the reorder
    logic be checked against transformers' beam search before shared pages exist."""

    def fork(self, handle: int, n: int = 1) -> np.ndarray:
        new = self.open(n)
        length = int(self.allocator.length(handle))
        src = self.allocator.slots(handle)
        ext = self.extend(new, length)
        for layer in range(self.num_layers):
            k, v = self.read(layer, src)
            for i in range(n):
                self.write(layer, ext.slots[i * length:(i + 1) * length], k, v)
        return new


@pytest.mark.parametrize("pool_kind", ["copy-fork", "core-fork"])
def test_beam_search_matches_dynamic_cache(models, pool_kind):
    model = models["llama"]
    ids, mask = left_padded([6, 9], seed=1)
    ref = greedy(model, ids, mask, 12, num_beams=3, output_scores=True)
    cls = CopyForkPool if pool_kind == "copy-fork" else KVPool
    cfg = model.config
    pool = cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.float32,
               page_size=4, num_slots=1024, max_context_len=64)
    with KVPoolCache(pool) as cache:
        out = greedy(model, ids, mask, 12, cache=cache, num_beams=3, output_scores=True)
        assert len(cache.handles) == 6
    assert torch.equal(ref.sequences, out.sequences)
    assert torch.allclose(ref.sequences_scores, out.sequences_scores, atol=TOL)
    assert pool.allocator.used_pages == 0
    pool.allocator.check()


def test_errors_are_typed_and_leave_the_pool_unchanged(models):
    model = models["llama"]
    ids, mask = left_padded([5, 8], seed=2)
    wrong_heads = KVPool(2, 4, 16, dtype=torch.float32, num_slots=256, max_context_len=64)
    with KVPoolCache(wrong_heads) as cache, pytest.raises(TensorShapeError, match="num_key_value_heads|kv heads"):
        greedy(model, ids, mask, 4, cache=cache)
    assert wrong_heads.allocator.open_requests == 0
    wrong_dtype = pool_for_model(model, max_tokens=256, dtype=torch.float16, max_context_len=64)
    with KVPoolCache(wrong_dtype) as cache, pytest.raises(TensorDtypeError, match="model's dtype"):
        greedy(model, ids, mask, 4, cache=cache)
    # 2 rows x (8 + 31) tokens do not fit in 32 slots: a typed error, then every page back.
    small = pool_for_model(model, max_tokens=32, page_size=16, max_context_len=64)
    with KVPoolCache(small) as cache, pytest.raises(PoolExhaustedError):
        greedy(model, ids, mask, NEW_TOKENS, cache=cache)
    assert small.allocator.used_pages == 0
    small.allocator.check()


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_first_forward_that_does_not_fit_leaves_the_pool_as_it_was(models, page_size):
    """The first update opens the rows; when the prompt's extend then fails, the rows are
    closed again, so the pool (open requests included) is exactly as before, and the
    same cache serves the batch once there is room."""
    model = models["llama"]
    ids, mask = left_padded([10, 7, 4], seed=2)
    pool = pool_for_model(model, max_tokens=48, page_size=page_size, max_requests=4, max_context_len=64)
    blocker = pool.open(1)
    pool.extend(blocker, 20)  # 3 rows of 10 no longer fit
    a = pool.allocator

    def counters():
        a.check()
        return a.open_requests, a.used_pages, a.free_pages, a.used_slots, a.admissible_tokens

    before = counters()
    cache = KVPoolCache(pool)
    with pytest.raises(PoolExhaustedError):
        greedy(model, ids, mask, 2, cache=cache)
    assert counters() == before and cache.handles is None and cache.get_seq_length() == 0
    pool.close(blocker)  # room now
    out = greedy(model, ids, mask, 2, cache=cache)
    assert torch.equal(out.sequences, greedy(model, ids, mask, 2).sequences)
    cache.close()
    assert a.open_requests == 0 and a.used_pages == 0


def test_prefix_cache_gives_identical_outputs_and_computes_only_new_tokens(models):
    model = models["llama"]
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 90, (40,), generator=g)
    prompts = [torch.cat([shared, torch.randint(3, 90, (n,), generator=g)])[None] for n in (5, 9)]
    pool = pool_for_model(model, max_tokens=1024, page_size=16, max_context_len=128)
    fed: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: fed.append(i[0].shape[1]))
    try:
        outs = {}
        for on in (False, True):
            outs[on] = []
            for p in prompts:
                fed.clear()
                cache = KVPoolCache(pool, prefix_ids=p) if on else KVPoolCache(pool)
                with cache:
                    outs[on].append(greedy(model, p, None, NEW_TOKENS, cache=cache))
                    hit = int(cache.cached_lens[0]) if on else 0
                assert fed[0] == p.shape[1] - hit  # the prefill computed only the uncached tokens
            if on:
                assert hit == 32  # the second prompt reused the two full shared pages
    finally:
        hook.remove()
    for off, on in zip(outs[False], outs[True]):
        assert_same_generation(off, on)
    pool.allocator.check()


def test_prefix_ids_without_shared_pages_is_a_clear_error(models):
    pool = pool_for_model(models["llama"], max_tokens=64, max_context_len=64)
    with pytest.raises(NotImplementedError, match="open_with_prefix"):
        KVPoolCache(_PoolWithout(pool, "open_with_prefix"), prefix_ids=torch.ones(1, 4, dtype=torch.long))
    assert pool.allocator.open_requests == 0


def test_core_package_imports_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import kvpool, kvpool.integrations, kvpool.demo.cli\n"
        "try:\n    import kvpool.integrations.transformers\nexcept ImportError as e:\n"
        "    assert \"kvpool[hf]\" in str(e), e; print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.parametrize("layout", ["token", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_update_returns_every_row_in_token_order(layout, dtype):
    """Direct update calls (no model): each layer gets back exactly what it stored, per row,
    in token order, on both layouts; an fp8 pool returns the dequantized round trip."""
    pool = KVPool(2, 2, 8, dtype=dtype, compute_dtype=torch.float32 if dtype != torch.float32 else None,
                  page_size=4, num_slots=128, max_context_len=32, layout=layout)
    g = torch.Generator().manual_seed(0)
    stored = {layer: ([], []) for layer in range(2)}
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        for t in (5, 1, 1, 3):  # a prefill, two decode steps, a 3-token chunk
            for layer in range(2):
                k, v = (torch.randn(3, 2, t, 8, generator=g) for _ in range(2))
                stored[layer][0].append(k)
                stored[layer][1].append(v)
                got_k, got_v = cache.update(k, v, layer)
                want_k, want_v = (torch.cat(x, dim=2) for x in stored[layer])
                if dtype != torch.float32:
                    want_k, want_v = (x.to(dtype).float() for x in (want_k, want_v))  # scale 1
                assert got_k.shape == (3, 2, sum(x.shape[2] for x in stored[layer][0]), 8)
                assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
            assert cache.get_seq_length() == cache.get_seq_length(1) == got_k.shape[2]
        cache.update(torch.randn(3, 2, 2, 8), torch.randn(3, 2, 2, 8), 1)  # any layer may start a step
        with pytest.raises(RuntimeError, match="same tokens"):
            cache.update(torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8), 0)  # but all must match it
        with pytest.raises(TensorShapeError, match="rows"):
            cache.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), 0)  # batch changed
    pool.allocator.check()
    assert pool.allocator.used_pages == 0


def test_cache_continuation_across_generate_calls(models):
    """A second generate on prompt + output + a new turn reuses the cache (only the new
    tokens are computed), as with DynamicCache."""
    model = models["qwen2"]
    ids, _ = left_padded([10], seed=9)
    pool = pool_for_model(model, max_tokens=256, page_size=16, max_context_len=96)
    results = []
    with KVPoolCache(pool) as cache:
        for c in (DynamicCache(config=model.config), cache):
            first = greedy(model, ids, None, 8, cache=c)
            turn = torch.cat([first.sequences, torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(1))], 1)
            results.append(greedy(model, turn, None, NEW_TOKENS, cache=c))
        assert pool.allocator.lengths(cache.handles).tolist() == [10 + 8 + 6 + NEW_TOKENS - 1]
    assert_same_generation(*results)
    pool.allocator.check()


def test_pool_for_model_records_no_events_unless_asked(models):
    """KVPoolCache never drains KV events, so a pool built for it does not record
    them (they would pile up); a router that wants them passes kv_events=True."""
    prompt = np.arange(40) % 7

    def serve(pool):
        h, cached = pool.open_with_prefix(prompt, [len(prompt)])
        pool.extend(h, len(prompt) - int(cached[0]), tokens=prompt[int(cached[0]):])
        pool.close(h, cache=True)
        return pool.take_events()["kind"]

    quiet = pool_for_model(models["llama"], max_tokens=256, page_size=16, max_context_len=64)
    assert len(serve(quiet)) == 0 and quiet.cached_pages == 2
    loud = pool_for_model(models["llama"], max_tokens=256, page_size=16, max_context_len=64, kv_events=True)
    assert serve(loud).tolist() == [0, 0]
