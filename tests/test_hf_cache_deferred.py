"""Decode steps that KVPoolCache defers: inside a page its private rows already own, on a CPU
pool with layer buffers, a step's token goes to the layer buffers alone, and the core and the
pool's caches catch up with one extend and one store (``flush``) at the next page, before any
edit of the rows (crop, reorder, select) and when the handles are read. These tests drive the
cache's layers by hand and read the pool through handles taken before (no flush), so that
what is deferred, and when it lands, is seen."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch

from test_hf_cache_steps import LAYERS, PAGE, D, H, make_pool, scramble, stored_in_pool  # noqa: E402

from kvpool import (  # noqa: E402
    ContextTooLongError,
    IncompleteForwardError,
    InvalidArgumentError,
    KVPool,
    PoolExhaustedError,
    TooManyRequestsError,
)
from kvpool.integrations import _buffer_steps, _layer_buffers  # noqa: E402
from kvpool.integrations._requests import BatchRequests  # noqa: E402
from kvpool.integrations.transformers import KVPoolCache  # noqa: E402
from kvpool.rows import scatter_into  # noqa: E402


class Reference:
    """Every layer's K/V as fed to the cache, per row: what attention and the pool must hold."""

    def __init__(self, batch: int, seed: int = 0) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.batch = batch
        self.k: list[torch.Tensor] = [torch.empty(batch, H, 0, D) for _ in range(LAYERS)]

    def step(self, cache: KVPoolCache, tokens: int) -> None:
        for layer in range(LAYERS):
            k = torch.randn(self.batch, H, tokens, D, generator=self.g)
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)
            got_k, got_v = cache.update(k, 2 * k, layer)
            assert torch.equal(got_k, self.k[layer]) and torch.equal(got_v, 2 * self.k[layer]), f"layer {layer}"

    def crop(self, length: int) -> None:
        self.k = [k[:, :, :length] for k in self.k]

    def reorder(self, sources: list[int]) -> None:
        self.k = [k[sources] for k in self.k]
        self.batch = len(sources)

    def check_pool(self, pool: KVPool, handles: np.ndarray) -> None:
        for layer in range(LAYERS):
            k, v = stored_in_pool(pool, handles, layer)
            assert torch.equal(k, self.k[layer]) and torch.equal(v, 2 * self.k[layer]), f"layer {layer}"


def reorder_and_decode_past_a_page(pool: KVPool, cache: KVPoolCache, ref: Reference, order: list[int],
                                   device: str | None = None) -> None:
    """Reorders the rows as beam search does (a row kept twice is forked), checks the pool holds
    every row's tokens, then decodes past the next page start and checks again."""
    cache.reorder_cache(torch.tensor(order, device=device))
    ref.reorder(order)
    ref.check_pool(pool, cache.handles)
    for _ in range(PAGE + 1):
        ref.step(cache, 1)
    ref.check_pool(pool, cache.handles)


def decode_three_pages(pool: KVPool, cache: KVPoolCache, ref: Reference) -> np.ndarray:
    """A 5-token prompt, then three pages of decode steps, checking after each that the core
    lags the cache by exactly the deferred steps and that only a page's first step extends it;
    then a flush. Returns the handles, read before any flush."""
    batch = ref.batch
    ref.step(cache, 5)
    raw = cache.requests.handles  # read without flushing
    seen_deferred = []
    for length in range(6, 6 + 3 * PAGE):
        ref.step(cache, 1)
        deferred = cache.requests.deferred
        seen_deferred.append(deferred)
        core = pool.allocator.lengths(raw).tolist()
        assert core == [length - deferred] * batch
        # A step that starts a page extends the core (after catching it up): nothing deferred.
        assert (deferred == 0) == ((length - 1) % PAGE == 0), (length, deferred)
    assert max(seen_deferred) == PAGE - 1
    cache.flush()
    assert cache.requests.deferred == 0 and pool.allocator.lengths(raw).tolist() == [5 + 3 * PAGE] * batch
    return raw


@pytest.mark.parametrize("keep_views", [True, False], ids=["views-kept", "views-made-per-step"])
@pytest.mark.parametrize("batch", [1, 3])
def test_steps_inside_a_page_reach_the_core_and_the_caches_at_the_next_page(batch, keep_views, monkeypatch):
    # Layer buffers too large to keep their views (a long context on many layers) make each
    # deferred step's views with its page's plan rather than take them from the buffers' store.
    if not keep_views:
        monkeypatch.setattr(_layer_buffers, "MAX_KEPT_VIEWS", 0)
    pool = make_pool()
    scramble(pool)
    ref = Reference(batch)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        raw = decode_three_pages(pool, cache, ref)
        assert cache.requests.pages._lb.keep == keep_views
        ref.check_pool(pool, raw)
        pool.allocator.check()
    pool.allocator.check()
    assert pool.allocator.used_pages == 0


def test_a_later_cache_on_the_kept_buffers_takes_their_plans_and_holds_its_own_tokens():
    """Layer buffers that keep their views keep the deferred plans made of them: the next cache
    that takes them (the same pool, rows and room) takes each page's plan as it was made, and
    attention and the pool get that cache's own tokens."""
    pool = make_pool()
    scramble(pool)
    kept = []
    for seed in (0, 1):
        ref = Reference(2, seed)
        with torch.inference_mode(), KVPoolCache(pool) as cache:
            raw = decode_three_pages(pool, cache, ref)
            ref.check_pool(pool, raw)
            lb = cache.requests.pages._lb
            kept.append((lb, dict(lb.plans)))
        pool.allocator.check()
    (first, plans), (second, again) = kept
    assert second is first and plans and again.keys() == plans.keys()
    assert all(again[key] is plans[key] for key in plans)
    assert pool.allocator.used_pages == 0


@pytest.mark.parametrize("keep_views", [True, False], ids=["views-kept", "views-made-per-step"])
def test_a_later_cache_of_the_same_prompt_length_takes_its_kept_views(keep_views, monkeypatch):
    """Layer buffers that keep their views keep those of a prompt step too (a few lengths): the
    next cache's prompt of that length, on the same buffers, adds its tokens through them, and
    attention and the pool get that cache's own tokens; buffers too large to keep views make them."""
    if not keep_views:
        monkeypatch.setattr(_layer_buffers, "MAX_KEPT_VIEWS", 0)
    pool = make_pool()
    scramble(pool)
    seen = []
    for seed in (0, 1):
        ref = Reference(2, seed)
        with torch.inference_mode(), KVPoolCache(pool) as cache:
            ref.step(cache, 5)
            ref.step(cache, 1)
            ref.check_pool(pool, cache.handles)
            lb = cache.requests.pages._lb
            seen.append((lb, lb._prompts.get((0, 5))))
        pool.allocator.check()
    (first, views), (second, again) = seen
    assert second is first
    assert (again is views and views is not None) if keep_views else (views is None and again is None)
    assert pool.allocator.used_pages == 0


def test_a_deferred_step_takes_the_short_way_and_leaves_every_refusal_to_begin_step(monkeypatch):
    """``KVPoolCache.update`` starts a deferred decode step without ``begin_step`` (its checks
    inline); a step those checks would not pass, here after a forward cut short, goes
    ``begin_step``'s way, which refuses it with the rows as they were."""
    calls = []
    real = BatchRequests.begin_step

    def counted(self, tokens, grad=None):
        calls.append(tokens)
        return real(self, tokens, grad)

    monkeypatch.setattr(BatchRequests, "begin_step", counted)
    pool = make_pool()
    scramble(pool)
    ref = Reference(1)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        ref.step(cache, PAGE + 1)  # the prompt ends one token into its last page
        for _ in range(PAGE - 1):  # that page's other steps, deferred
            ref.step(cache, 1)
        assert calls == [PAGE + 1] and cache.requests.deferred == PAGE - 1
        ref.step(cache, 1)  # the next page's first step extends the core
        assert calls == [PAGE + 1, 1] and cache.requests.deferred == 0
        k = torch.ones(1, H, 1, D)
        cache.update(k, k, 0)  # a deferred step cut short after its first layer
        length, deferred = cache.requests.length, cache.requests.deferred
        with pytest.raises(IncompleteForwardError, match="cut short"):
            cache.update(k, k, 0)
        assert calls[2:] == [1] and (cache.requests.length, cache.requests.deferred) == (length, deferred)
    pool.allocator.check()
    assert pool.allocator.used_pages == 0


def test_a_one_row_flush_at_a_page_end_stores_its_run_without_numpy_checks(monkeypatch):
    """One row's flush at a page's end (a batch-1 generate's): the page's first token and the
    deferred steps' are one run of slots, checked as Python ints and stored with one copy
    (``store_run``), never through ``slot_run``; the pool then holds every token."""
    runs, checked = [], []
    real_run, real_check = _buffer_steps.BufferSteps.store_run, _buffer_steps.slot_run
    monkeypatch.setattr(_buffer_steps.BufferSteps, "store_run",
                        lambda self, first, n, run: (runs.append(n), real_run(self, first, n, run))[1])
    monkeypatch.setattr(_buffer_steps, "slot_run", lambda *a: (checked.append(a[2]), real_check(*a))[1])
    pool = make_pool()
    scramble(pool)
    ref = Reference(1)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        raw = decode_three_pages(pool, cache, ref)
        ref.check_pool(pool, raw)
    # The first page end also stores the prompt, checked by slot_run (more than one token before
    # the deferred steps; scrambled pages, so stored through an index); the next two store PAGE
    # tokens each without it. (The fourth page's first step grows the buffers, so its layers
    # store it, and decode_three_pages' last flush has nothing to store.)
    assert runs == [PAGE, PAGE] and checked == [5 + PAGE - 1], (runs, checked)
    pool.allocator.check()


@pytest.mark.parametrize("row_copy", [True, False], ids=["core-row-copy", "index_copy_"])
def test_a_flush_of_rows_whose_pages_are_out_of_order_stores_every_layer(row_copy, monkeypatch):
    """Rows whose pages are not one strided run (a pool that served others first): the flush
    stores every layer's K and V with one call of the core's row copy, or with ``index_copy_``
    where that call declines (a TorchDispatchMode, torch.compile), the same values either way."""
    calls = []

    def spy(caches, idx, src):
        calls.append(idx.shape[0])
        return scatter_into(caches, idx, src) if row_copy else False

    monkeypatch.setattr(_buffer_steps, "scatter_into", spy)
    pool = make_pool()
    scramble(pool)
    ref = Reference(3)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        raw = decode_three_pages(pool, cache, ref)
        ref.check_pool(pool, raw)
    # Every flush of the deferred steps stored each layer's K and V of every row's tokens.
    assert calls and all(n % (2 * LAYERS * 3) == 0 for n in calls), calls
    pool.allocator.check()


def test_no_step_past_the_context_length_is_deferred():
    """The context length ends a page early: the step past it is refused when it is taken,
    with the rows as they were, and the pool holds every token up to the limit."""
    pool = KVPool(LAYERS, H, D, dtype=torch.float32, page_size=PAGE, num_slots=1024, max_requests=8,
                  max_context_len=2 * PAGE + 2)
    h = pool.open(3)  # interleaved pages (``scramble``'s longer rows would pass this context length)
    for _ in range(2 * PAGE + 1):
        pool.extend(h, 1)
    pool.close(h)
    ref = Reference(2)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        ref.step(cache, 5)
        for _ in range(2 * PAGE + 2 - 5):
            ref.step(cache, 1)
        k = torch.randn(2, H, 1, D)
        with pytest.raises(ContextTooLongError, match=f"batch's rows to {2 * PAGE + 3} tokens"):
            cache.update(k, k, 0)
        assert cache.get_seq_length() == 2 * PAGE + 2
        ref.check_pool(pool, cache.handles)
        assert pool.allocator.lengths(cache.handles).tolist() == [2 * PAGE + 2] * 2


@pytest.mark.parametrize("drop", [1, 2, PAGE + 1])
def test_crop_into_deferred_steps_keeps_the_rest_and_decoding_goes_on(drop):
    pool = make_pool()
    scramble(pool)
    ref = Reference(3, seed=1)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        ref.step(cache, 5)
        for _ in range(PAGE + 2):  # ends two steps into a page, both deferred
            ref.step(cache, 1)
        assert cache.requests.deferred == 2
        length = cache.get_seq_length()
        cache.crop(-drop)
        ref.crop(length - drop)
        raw = cache.requests.handles
        assert pool.allocator.lengths(raw).tolist() == [length - drop] * 3
        ref.check_pool(pool, raw)
        for _ in range(PAGE + 1):
            ref.step(cache, 1)
        ref.check_pool(pool, cache.handles)
    pool.allocator.check()
    assert pool.allocator.used_pages == 0


def test_reorder_forks_rows_with_their_deferred_tokens():
    """Beam search's reorder forks a row that continues twice: the fork shares the row's pages
    as the pool holds them, so the deferred tokens must be there first."""
    pool = make_pool()
    scramble(pool)
    ref = Reference(2, seed=2)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        ref.step(cache, 5)
        ref.step(cache, 1)
        ref.step(cache, 1)
        assert cache.requests.deferred == 2
        reorder_and_decode_past_a_page(pool, cache, ref, [1, 1, 0])
    pool.allocator.check()
    assert pool.allocator.used_pages == 0


def test_closing_with_deferred_steps_gives_every_page_back():
    pool = make_pool()
    scramble(pool)
    ref = Reference(3, seed=3)
    with torch.inference_mode():
        cache = KVPoolCache(pool)
        ref.step(cache, 5)
        ref.step(cache, 1)
        assert cache.requests.deferred == 1
        cache.close()
    assert pool.allocator.used_pages == 0 and pool.allocator.open_requests == 0
    pool.allocator.check()


def test_steps_are_not_deferred_without_layer_buffers_or_in_prefix_mode():
    """Only layer buffers hold a deferred token; rows opened on a cached prefix share pages."""
    pool = make_pool()
    scramble(pool)
    with torch.inference_mode():
        with KVPoolCache(pool, layer_buffers=False) as cache:
            ref = Reference(2, seed=4)
            ref.step(cache, 5)
            for _ in range(PAGE):
                ref.step(cache, 1)
                assert cache.requests.deferred == 0
        ids = torch.arange(10, 10 + 2 * PAGE + 1).reshape(1, -1)
        with KVPoolCache(pool, prefix_ids=ids) as cache:
            ref = Reference(1, seed=5)
            ref.step(cache, ids.shape[1])
        with KVPoolCache(pool, prefix_ids=ids) as cache:
            assert cache.get_seq_length() == 2 * PAGE  # the prompt's full pages were cached
            for _ in range(PAGE):
                k = torch.randn(1, H, 1, D)
                for layer in range(LAYERS):
                    cache.update(k, k, layer)
                assert cache.requests.deferred == 0
    pool.allocator.check()


@pytest.mark.parametrize("batch", [1, 3])
def test_handles_read_mid_step_flush_the_steps_done_and_keep_the_one_under_way(batch):
    """Reading the handles between two layers of a deferred step extends the core by it and
    stores the steps every layer has run; the step under way is stored by the next flush."""
    pool = make_pool()
    scramble(pool)
    ref = Reference(batch, seed=6)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        ref.step(cache, 5)
        ref.step(cache, 1)  # deferred
        ks = [torch.randn(batch, H, 1, D, generator=ref.g) for _ in range(LAYERS)]
        cache.update(ks[0], 2 * ks[0], 0)  # deferred too, one layer in
        raw = cache.handles
        assert cache.requests.deferred == 0 and pool.allocator.lengths(raw).tolist() == [7] * batch
        for layer in range(LAYERS):
            k, v = stored_in_pool(pool, raw, layer)
            assert torch.equal(k[:, :, :6], ref.k[layer]) and torch.equal(v[:, :, :6], 2 * ref.k[layer])
        for layer in range(1, LAYERS):
            cache.update(ks[layer], 2 * ks[layer], layer)
        ref.k = [torch.cat([k, new], dim=2) for k, new in zip(ref.k, ks)]
        cache.flush()
        ref.check_pool(pool, raw)
        ref.step(cache, 1)
        ref.check_pool(pool, cache.handles)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("before", [[5, 3], [8]], ids=["after-a-prompt-step", "page-start"])
def test_handles_read_mid_step_hold_the_token_of_the_layers_that_ran(batch, before):
    """A decode step that is not deferred but stored from the layer buffers (the step that
    starts a page, or the first after a multi-token step): reading the handles between two
    of its layers brings the pool up to the cache there too, so the layers that ran have
    their token in the pool, and the next flush stores the step again once all have."""
    pool = make_pool()
    scramble(pool)
    ref = Reference(batch, seed=7)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        for t in before:
            ref.step(cache, t)
        ks = [torch.randn(batch, H, 1, D, generator=ref.g) for _ in range(LAYERS)]
        cache.update(ks[0], 2 * ks[0], 0)
        assert cache.requests.deferred == 0 and cache.requests.later, "the test needs a step stored from the buffers"
        raw = cache.handles
        assert pool.allocator.lengths(raw).tolist() == [sum(before) + 1] * batch
        k, v = stored_in_pool(pool, raw, 0)
        assert torch.equal(k[:, :, -1:], ks[0]) and torch.equal(v[:, :, -1:], 2 * ks[0])
        for layer in range(1, LAYERS):
            cache.update(ks[layer], 2 * ks[layer], layer)
        ref.k = [torch.cat([k, new], dim=2) for k, new in zip(ref.k, ks)]
        cache.flush()  # stores the step again, now that every layer has run
        ref.check_pool(pool, raw)


def test_a_refused_reorder_leaves_deferred_steps_deferred():
    """Bad row indices are refused with the pool exactly as it was: the deferred steps are
    not flushed by a reorder that does not happen (handles taken before still read the
    lengths they did)."""
    pool = make_pool()
    scramble(pool)
    ref = Reference(2, seed=8)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        ref.step(cache, 5)
        ref.step(cache, 1)
        ref.step(cache, 1)
        raw = cache.requests.handles
        lengths = pool.allocator.lengths(raw).tolist()
        assert cache.requests.deferred == 2 and lengths == [5] * 2
        for bad in ([0, 2], [-1]):
            with pytest.raises(InvalidArgumentError, match="outside the batch"):
                cache.reorder_cache(torch.tensor(bad))
            with pytest.raises(InvalidArgumentError, match="outside the batch"):
                cache.batch_select_indices(torch.tensor(bad))
        assert cache.requests.deferred == 2 and pool.allocator.lengths(raw).tolist() == lengths
        ref.step(cache, 1)
        ref.check_pool(pool, cache.handles)


def test_a_step_refused_at_the_next_page_leaves_the_deferred_steps_deferred():
    """The step after a page's deferred ones needs a new page; on a full pool it is refused
    (PoolExhaustedError) with the pool exactly as it was: the catch-up extend made for it
    is undone, so handles taken before still read the lengths they did, and once there is
    room the step goes on with the deferred tokens intact."""
    pool = KVPool(LAYERS, H, D, dtype=torch.float32, page_size=PAGE, num_slots=256, max_requests=8,
                  max_context_len=128)
    scramble(pool)
    ref = Reference(2, seed=9)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        ref.step(cache, 5)
        for _ in range(3):
            ref.step(cache, 1)
        raw = cache.requests.handles
        assert cache.requests.deferred == 3 and pool.allocator.lengths(raw).tolist() == [5] * 2
        hogs = []
        while pool.allocator.free_pages > 1:  # one page left: the step needs one per row
            h = pool.open(1)
            pool.extend(h, min((pool.allocator.free_pages - 1) * PAGE, 128))
            hogs.append(int(h[0]))
        used, free = pool.allocator.used_pages, pool.allocator.free_pages
        k = torch.randn(2, H, 1, D)
        with pytest.raises(PoolExhaustedError):
            cache.update(k, k, 0)
        assert cache.get_seq_length() == 8 and cache.requests.deferred == 3
        assert pool.allocator.lengths(raw).tolist() == [5] * 2
        assert (pool.allocator.used_pages, pool.allocator.free_pages) == (used, free)
        pool.close(np.asarray(hogs, dtype=np.int64))
        for _ in range(PAGE + 1):
            ref.step(cache, 1)
        ref.check_pool(pool, cache.handles)
    pool.allocator.check()
    assert pool.allocator.used_pages == 0


def test_a_fork_refused_leaves_the_deferred_steps_deferred():
    """Beam search's reorder catches the pool up before it forks; a fork refused (no request
    left: TooManyRequestsError) undoes that too, leaving the pool as it was."""
    pool = make_pool()  # max_requests=8
    scramble(pool)
    ref = Reference(2, seed=10)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        ref.step(cache, 5)
        ref.step(cache, 1)
        raw = cache.requests.handles
        hogs = pool.open(6)
        with pytest.raises(TooManyRequestsError):
            cache.reorder_cache(torch.tensor([0, 0, 1]))
        assert cache.requests.deferred == 1 and pool.allocator.lengths(raw).tolist() == [5] * 2
        pool.close(hogs)
        cache.reorder_cache(torch.tensor([0, 0, 1]))
        ref.reorder([0, 0, 1])
        ref.step(cache, 1)
        ref.check_pool(pool, cache.handles)
    pool.allocator.check()
    assert pool.allocator.used_pages == 0
