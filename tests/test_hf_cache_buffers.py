"""KVPoolCache's layer buffers: when the rows' pages are gathered, each layer keeps its
rows' K/V between steps and adds each step's tokens. Every edit that changes what a row
holds (crop, reorder, beam, rows leaving or joining, reset) must make the next step
gather again; a page boundary must not (the buffer keeps growing). Each test keeps the
expected K/V of every row and compares every update's result with it, so a stale buffer
fails the comparison."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch

from kvpool import KVPool  # noqa: E402
from kvpool.integrations.transformers import KVPoolCache  # noqa: E402

H, D, LAYERS, PAGE = 2, 8, 3, 4


def make_pool(layout: str = "token") -> KVPool:
    return KVPool(LAYERS, H, D, dtype=torch.float32, page_size=PAGE, num_slots=2048, max_requests=16,
                  max_context_len=128, layout=layout)


class Expect:
    """Feeds random K/V to every layer of a cache and checks each result against the K/V
    every row should hold (``rows[layer]``: ``[B, H, L, D]``)."""

    def __init__(self, cache: KVPoolCache, seed: int = 0) -> None:
        self.cache, self.g = cache, torch.Generator().manual_seed(seed)
        self.rows: list[torch.Tensor | None] = [None] * LAYERS
        # per step: layer 0's K came from the layer buffers (a copy of them under grad mode)
        self.buffered: list[bool] = []

    def step(self, batch: int, t: int) -> None:
        for layer in range(LAYERS):
            k = torch.randn(batch, H, t, D, generator=self.g)
            held = self.rows[layer]
            self.rows[layer] = k if held is None else torch.cat([held, k], dim=2)
            got_k, got_v = self.cache.update(k, -k, layer)
            want = self.rows[layer]
            assert torch.equal(got_k, want) and torch.equal(got_v, -want), f"layer {layer} got stale K/V"
            if layer == 0:
                pages = self.cache.requests.pages
                buf, views = pages._buf, pages._views
                self.buffered.append(buf is not None and views is not None
                                     and views[0][0].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr())

    def edit(self, fn) -> None:
        self.rows = [None if r is None else fn(r) for r in self.rows]


def interleave(pool: KVPool, cache: KVPoolCache, e: Expect, batch: int) -> None:
    """A prompt, then decode steps across a page boundary: the rows take their new pages in
    turn, so from then on attention reads the layer buffers."""
    e.step(batch, 5)
    for _ in range(PAGE):
        e.step(batch, 1)
    assert e.buffered[-1], "the test needs rows whose pages are gathered"


@pytest.mark.parametrize("layout", ["token", "paged"])
def test_page_boundaries_add_to_the_buffer_without_gathering_again(layout, monkeypatch):
    pool = make_pool(layout)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        e = Expect(cache)
        interleave(pool, cache, e, 3)
        pages = cache.requests.pages
        gathers = []
        real = pages._gather_layer
        monkeypatch.setattr(pages, "_gather_layer", lambda layer: (gathers.append(layer), real(layer)))
        caps = [pages._cap]
        for _ in range(6 * PAGE):  # several page boundaries, and the buffers outgrow their room
            e.step(3, 1)
            caps.append(pages._cap)
        growths = sum(a != b for a, b in zip(caps, caps[1:]))
        assert growths >= 1
        assert all(e.buffered[-6 * PAGE:])
        # Growing the buffers is the one time they are gathered again (once per layer).
        assert len(gathers) == LAYERS * growths
    pool.allocator.check()
    assert pool.allocator.used_pages == 0


def test_a_prompts_buffers_have_room_for_the_next_pages(monkeypatch):
    """Buffers made for a prompt get room to grow, as a growing buffer does: the decode
    steps that take the next pages add to them and gather nothing."""
    pool = make_pool()
    h = pool.open(3)  # leave the free pages out of order, so that the prompt is gathered
    for _ in range(3 * PAGE + 1):
        pool.extend(h, 1)
    pool.close(h)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        e = Expect(cache)
        e.step(3, 2 * PAGE)  # a prompt of two whole pages
        assert e.buffered[-1], "the test needs a prompt read from the layer buffers"
        pages = cache.requests.pages
        gathers: list[int] = []
        real = pages._gather_layer
        monkeypatch.setattr(pages, "_gather_layer", lambda layer: (gathers.append(layer), real(layer)))
        for _ in range(2 * PAGE):
            e.step(3, 1)
        assert all(e.buffered[1:])
        assert gathers == [], "the prompt's buffers were gathered again at a page boundary"
    pool.allocator.check()


def test_crop_then_continue():
    pool = make_pool()
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        e = Expect(cache)
        interleave(pool, cache, e, 3)
        cache.crop(-2)
        e.edit(lambda r: r[:, :, :-2])
        e.step(3, 2)  # back to the length before the crop: a buffer not told would look full
        e.step(3, 1)
        assert e.buffered[-1]


@pytest.mark.parametrize("order", [[2, 0, 1], [1, 1, 0], [0, 0, 0]])
def test_reorder_and_beam_rows(order):
    pool = make_pool()
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        e = Expect(cache)
        interleave(pool, cache, e, 3)
        cache.reorder_cache(torch.tensor(order))
        e.edit(lambda r: r[order])
        for _ in range(PAGE + 1):
            e.step(3, 1)
    pool.allocator.check()
    assert pool.allocator.used_pages == 0


def test_rows_leaving_and_joining():
    pool = make_pool()
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        e = Expect(cache)
        interleave(pool, cache, e, 4)
        cache.batch_select_indices(torch.tensor([3, 1]))  # two rows leave
        e.edit(lambda r: r[[3, 1]])
        for _ in range(PAGE):
            e.step(2, 1)
        cache.batch_repeat_interleave(2)  # each row joined by a copy of itself
        e.edit(lambda r: r.repeat_interleave(2, dim=0))
        for _ in range(PAGE):
            e.step(4, 1)
        cache.batch_select_indices(torch.tensor([True, False, True, True]))
        e.edit(lambda r: r[[0, 2, 3]])
        e.step(3, 1)
    pool.allocator.check()
    assert pool.allocator.used_pages == 0


def test_reset_then_a_new_batch_of_the_same_size():
    pool = make_pool()
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        e = Expect(cache)
        interleave(pool, cache, e, 3)
        cache.reset()
        e2 = Expect(cache, seed=1)
        interleave(pool, cache, e2, 3)  # same lengths as before: only new values tell them apart
        for _ in range(PAGE):
            e2.step(3, 1)
    pool.allocator.check()
    assert pool.allocator.used_pages == 0


def test_without_layer_buffers_every_step_gathers_the_same_values():
    pool = make_pool()
    with torch.inference_mode(), KVPoolCache(pool, layer_buffers=False) as cache:
        e = Expect(cache)
        e.step(3, 5)
        for _ in range(2 * PAGE):
            e.step(3, 1)
        assert cache.requests.pages._buf is None
        cache.reorder_cache(torch.tensor([1, 1, 2]))
        e.edit(lambda r: r[[1, 1, 2]])
        e.step(3, 1)
    pool.allocator.check()


def test_a_closed_caches_buffers_serve_the_next_cache_of_its_shape_until_released():
    """A closed cache leaves its layer buffers (and the views into them) to the pool's next
    cache of the same rows that fits in them, which must still read only its own K/V;
    ``release_buffers`` frees them."""
    import gc
    import weakref

    from kvpool.integrations.transformers import release_buffers

    pool = make_pool()
    with torch.inference_mode():
        cache = KVPoolCache(pool)
        interleave(pool, cache, Expect(cache), 3)
        first = cache.requests.pages._lb
        kept = weakref.ref(first)
        cache.close()
        again = KVPoolCache(pool)
        interleave(pool, again, Expect(again, seed=2), 3)  # other values: stale ones would fail
        assert again.requests.pages._lb is first, "the same rows and capacity take the spare"
        first = None
        again.close()
        other = KVPoolCache(pool)  # another batch size does not take it
        interleave(pool, other, Expect(other, seed=3), 4)
        assert other.requests.pages._lb is not kept()
        other.close()
    assert release_buffers(pool) > 0 and release_buffers(pool) == 0
    gc.collect()
    assert kept() is None, "released layer buffers are still alive"


def test_a_pool_keeps_at_most_four_spare_sets_none_over_the_size_limit():
    from kvpool.integrations._pool_views import pool_views

    pool = make_pool()
    spares = pool_views(pool).spare_buffers
    with torch.inference_mode():
        for batch in (2, 3, 4, 5, 6, 7):
            with KVPoolCache(pool) as cache:
                interleave(pool, cache, Expect(cache, seed=batch), batch)
            assert len(spares) == min(batch - 1, 4)
        with KVPoolCache(pool) as cache:  # the oldest (2 rows) went first: a new set is made
            interleave(pool, cache, Expect(cache, seed=9), 2)
            assert cache.requests.pages._lb.b == 2 and len(spares) == 4
        held = spares.nbytes
        spares.most_bytes = held // 8  # smaller than any set: closing keeps nothing new
        with KVPoolCache(pool) as cache:
            interleave(pool, cache, Expect(cache, seed=10), 8)
        assert spares.nbytes == held and len(spares) == 4


@pytest.mark.parametrize("mode", ["no_grad", "grad"])
def test_buffers_made_under_inference_mode_serve_a_cache_under_another_grad_mode(mode):
    pool = make_pool()
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        interleave(pool, cache, Expect(cache), 3)
    ctx = torch.no_grad() if mode == "no_grad" else torch.enable_grad()
    with ctx, KVPoolCache(pool) as cache:
        e = Expect(cache, seed=4)
        interleave(pool, cache, e, 3)
        for _ in range(PAGE):
            e.step(3, 1)
    pool.allocator.check()


@pytest.mark.parametrize("layer_buffers", [True, False])
def test_a_hybrid_pool_takes_the_same_arguments(layer_buffers):
    import transformers

    from kvpool.integrations.transformers import pool_for_model

    config = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=256,
        layer_types=["sliding_attention"] * 3 + ["full_attention"])
    pool = pool_for_model(config, max_tokens=64, page_size=4, max_requests=2)
    with KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        assert type(cache).__name__ == "HybridKVPoolCache"
        k = torch.randn(1, 2, 3, 16)
        got, _ = cache.update(k, k, 3)  # the full-attention layer
        assert torch.equal(got, k)
    assert pool.open_requests == 0


def test_caches_opened_at_once_on_threads_share_one_set_of_spares(monkeypatch):
    """A pool's first caches, made on two threads at once, get the same ``PoolViews`` (and so
    the same spares, which ``release_buffers`` frees): the loser of a race would keep spares
    of its own that ``release_buffers`` never reaches."""
    import threading

    from kvpool.integrations import _pool_views

    pool = make_pool()
    both_inside = threading.Barrier(2)
    made = _pool_views.PoolViews.__init__

    def slow_init(self, pool):
        try:  # both threads inside at once, unless one waits for the other (then it times out)
            both_inside.wait(timeout=1)
        except threading.BrokenBarrierError:
            pass
        made(self, pool)

    monkeypatch.setattr(_pool_views.PoolViews, "__init__", slow_init)
    got = [None, None]

    def take(i: int) -> None:
        got[i] = _pool_views.pool_views(pool)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0] is not None and got[0] is got[1]
    assert _pool_views.pool_views(pool) is got[0]


def test_release_buffers_frees_the_staging_buffers_closed_caches_left_too():
    """``layer_buffers=False`` caches leave their staging buffer (one layer's K/V of the
    batch, of any size) to the pool's next such cache; ``release_buffers`` frees those too."""
    import gc
    import weakref

    from kvpool.integrations.transformers import release_buffers

    pool = make_pool()
    h = pool.open(3)  # interleaved free pages: the cache gathers into its staging buffer
    for _ in range(3 * PAGE + 1):
        pool.extend(h, 1)
    pool.close(h)
    with torch.inference_mode():
        cache = KVPoolCache(pool, layer_buffers=False)
        e = Expect(cache)
        e.step(2, 5)
        for _ in range(PAGE):
            e.step(2, 1)
        stage = cache.requests.pages._stage
        assert stage is not None, "the test needs a cache that gathered into its staging buffer"
        kept, size = weakref.ref(stage), stage.numel() * stage.element_size()
        stage = None
        cache.close()
    assert release_buffers(pool) == size and release_buffers(pool) == 0
    gc.collect()
    assert kept() is None, "released staging buffers are still alive"
