"""How KVPoolCache stores a step and hands attention its K/V, on pools whose free pages
are no longer in order (as on a pool that served other batches): the step's stores
(views of the caches for a strided run of slots, the pool's index store otherwise, or,
for a step whose layers add their tokens to the layer buffers, one store of every layer's
tokens from the buffers at the next flush), the decode steps made ahead
at a page boundary, the staging buffer kept with the pool for its next cache, and the
short way a step's later layers take."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch

from kvpool import IncompleteForwardError, KVPool, TensorDtypeError, TensorShapeError  # noqa: E402
from kvpool.integrations.transformers import KVPoolCache  # noqa: E402

H, D, LAYERS, PAGE = 2, 8, 3, 4


def make_pool() -> KVPool:
    return KVPool(LAYERS, H, D, dtype=torch.float32, page_size=PAGE, num_slots=1024, max_requests=8,
                  max_context_len=128)


def scramble(pool: KVPool) -> None:
    """Leave the free pages out of order: three requests grow a token at a time in turn
    (their pages interleave), then close."""
    h = pool.open(3)
    for _ in range(3 * PAGE + 1):
        pool.extend(h, 1)
    pool.close(h)


def stored_in_pool(pool: KVPool, handles: np.ndarray, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's K/V of ``layer`` read back from the slots the allocator gave it, [B, H, L, D]."""
    ks, vs = [], []
    for h in handles:
        k, v = pool.read(layer, pool.allocator.slots(int(h)))
        ks.append(k.transpose(0, 1))
        vs.append(v.transpose(0, 1))
    return torch.stack(ks), torch.stack(vs)


def store_kind(cache: KVPoolCache) -> str:
    """How the step under way reaches the pool: 'views' (copies into views of the caches),
    'buffers' (every layer's tokens from the layer buffers, at the next flush) or 'index'
    (the pool's index store, layer by layer)."""
    req = cache.requests
    return "views" if req.dst is not None else "buffers" if req.later else "index"


def run(pool: KVPool, cache: KVPoolCache, batch: int, steps: list[int], seed: int = 0,
        on_step=None) -> list[tuple[str, bool]]:
    """Feed ``steps`` tokens per forward to every layer; check each returned K/V against
    what was stored and, after the step's last layer, against the pool's own slots; return
    per step how it was stored (``store_kind``) and whether a planned step was taken."""
    g = torch.Generator().manual_seed(seed)
    stored: dict[int, list[torch.Tensor]] = {layer: [] for layer in range(LAYERS)}
    kinds = []
    for i, t in enumerate(steps):
        if on_step is not None:
            on_step(i)
        plan_before = len(cache.requests.pages._plan)
        for layer in range(LAYERS):
            k = torch.randn(batch, H, t, D, generator=g)
            stored[layer].append(k)
            got_k, got_v = cache.update(k, 2 * k, layer)
            want = torch.cat(stored[layer], dim=2)
            assert torch.equal(got_k, want) and torch.equal(got_v, 2 * want)
        kinds.append((store_kind(cache), plan_before > 0 and len(cache.requests.pages._plan) == plan_before - 1))
        for layer in range(LAYERS):
            in_pool_k, in_pool_v = stored_in_pool(pool, cache.handles, layer)
            want = torch.cat(stored[layer], dim=2)
            assert torch.equal(in_pool_k, want) and torch.equal(in_pool_v, 2 * want)
    return kinds


@pytest.mark.parametrize("layer_buffers", [True, False])
def test_scattered_slots_are_stored_by_index_and_read_back(layer_buffers):
    """A prompt whose rows land on interleaved pages (no strided run of slots) is stored by
    index, and so are the decode steps while the rows' pages interleave: layer by layer
    without layer buffers, with them once per step from the buffers."""
    pool = make_pool()
    scramble(pool)
    with torch.inference_mode(), KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        kinds = run(pool, cache, 3, [6] + [1] * 9)
    # With layer buffers the pool gets every step from them at the next flush.
    assert kinds[0][0] == ("buffers" if layer_buffers else "index"), \
        "the prompt's slots should not be one strided run on a scrambled pool"
    decode = [kind for kind, _ in kinds[1:]]
    assert ("buffers" if layer_buffers else "index") in decode, decode
    assert "buffers" not in decode or layer_buffers
    assert any(planned for _, planned in kinds), "steps inside a page should come from the plan"
    pool.allocator.check()
    assert pool.allocator.used_pages == 0


@pytest.mark.parametrize("layer_buffers", [True, False])
def test_one_row_stores_through_views_and_takes_planned_steps(layer_buffers):
    pool = make_pool()
    scramble(pool)
    with torch.inference_mode(), KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        kinds = run(pool, cache, 1, [5] + [1] * 11)  # across three page boundaries
    # One row's decode slot is always a run: views of the caches, or (with layer buffers,
    # whose views attention reads while the row's pages are not consecutive) one copy of
    # every layer's token from the buffers into a view of the caches.
    decode = [kind for kind, _ in kinds[1:]]
    assert set(decode) <= {"views", "buffers"}, decode
    assert ("buffers" in decode) == layer_buffers, decode
    # Planned: every decode step that does not start a page (lengths 6, 7, 8, 10, 11, 12, 14, 15, 16).
    assert [planned for _, planned in kinds[1:]] == [length % PAGE != 1 for length in range(6, 17)]


def test_a_planned_step_whose_slots_differ_is_made_again():
    """The plan's slots are checked against the extend's: a plan that predicted other slots
    (here corrupted on purpose, pointing its stores at other slots) is dropped, and the
    step is made from the slots the allocator gave."""
    pool = make_pool()
    scramble(pool)

    def corrupt(step: int) -> None:
        plan = cache.requests.pages._plan
        if step == 1 and len(plan) > 1:
            want, _, _, views, out, app, decode = plan[-1]
            elsewhere = plan[0]  # a later step's stores: other slots of the same rows
            plan[-1] = ([s + 1 for s in want], elsewhere[1], elsewhere[2], views, out, app, decode)
        assert step != 1 or len(plan) > 1, "the test needs a plan of several steps here"

    # Without layer buffers: with them, a planned step's slots come from the core at the flush.
    with torch.inference_mode(), KVPoolCache(pool, layer_buffers=False) as cache:
        run(pool, cache, 2, [5] + [1] * 6, on_step=corrupt)
    pool.allocator.check()


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("before", [[5, 1], [7, 1]], ids=["made-ahead", "page-start"])
def test_a_forward_cut_short_is_refused_until_crop_drops_it(batch, before):
    """A buffered decode step is stored (at a flush) only whole: a flush between its layers
    stores it again at the next one. When a forward stops half-way (a model that raised),
    the next forward is refused
    (nothing changes), crop drops the unfinished step, and the step run again is stored
    and read back whole. The step cut short is one made ahead at the page's start, or
    (page-start) the step that starts a page."""
    pool = make_pool()
    scramble(pool)
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        run(pool, cache, batch, before)  # the next step stays in the buffers
        prior = [stored_in_pool(pool, cache.handles, layer) for layer in range(LAYERS)]
        for layer in range(LAYERS - 1):
            k = torch.randn(batch, H, 1, D, generator=g)
            cache.update(k, 2 * k, layer)
        assert store_kind(cache) == "buffers", "the test needs a step stored from the buffers"
        # A step made ahead is deferred (the core does not have it yet); reading the handles
        # flushes it into the core, while its K/V wait for the step to end on every layer.
        assert cache.requests.deferred == (1 if before == [5, 1] else 0)
        lengths, used = pool.allocator.lengths(cache.handles).tolist(), pool.allocator.used_pages
        assert cache.requests.deferred == 0 and lengths == [sum(before) + 1] * batch
        assert [u.shape[1] for u in cache.requests.unstored] == [1], "the step under way is not stored"
        k = torch.randn(batch, H, 1, D, generator=g)
        with pytest.raises(IncompleteForwardError, match=r"crop\(-1\)"):
            cache.update(k, 2 * k, 0)  # a new forward on the step cut short
        assert pool.allocator.lengths(cache.handles).tolist() == lengths and pool.allocator.used_pages == used
        cache.crop(-1)
        for layer in range(LAYERS):
            k = torch.randn(batch, H, 1, D, generator=g)
            want_k = torch.cat([prior[layer][0], k], dim=2)
            want_v = torch.cat([prior[layer][1], 2 * k], dim=2)
            got_k, got_v = cache.update(k, 2 * k, layer)
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), f"layer {layer}"
            prior[layer] = (want_k, want_v)
        for layer in range(LAYERS):
            in_pool_k, in_pool_v = stored_in_pool(pool, cache.handles, layer)
            assert torch.equal(in_pool_k, prior[layer][0]) and torch.equal(in_pool_v, prior[layer][1])
    pool.allocator.check()
    assert pool.allocator.used_pages == 0


def test_open_caches_keep_their_own_staging_and_a_closed_one_hands_it_on():
    pool = make_pool()
    scramble(pool)
    g = torch.Generator().manual_seed(3)
    a_cache, b_cache = KVPoolCache(pool, layer_buffers=False), KVPoolCache(pool, layer_buffers=False)
    with torch.inference_mode():
        ka, kb = torch.randn(2, H, 6, D, generator=g), torch.randn(2, H, 6, D, generator=g)
        got_a, _ = a_cache.update(ka, ka, 0)
        got_b, _ = b_cache.update(kb, kb, 0)  # must not overwrite what a's attention holds
        assert torch.equal(got_a, ka) and torch.equal(got_b, kb)
        stage = a_cache.requests.pages._stage
        assert stage is not None and stage is not b_cache.requests.pages._stage
        a_cache.close()
        c_cache = KVPoolCache(pool, layer_buffers=False)
        kc = torch.randn(2, H, 6, D, generator=g)
        got_c, _ = c_cache.update(kc, kc, 0)
        assert torch.equal(got_c, kc)
        assert c_cache.requests.pages._stage is stage, "the closed cache's staging buffer is reused"
        assert torch.equal(got_b, kb)
        b_cache.close()
        c_cache.close()
    pool.allocator.check()
    assert pool.allocator.used_pages == 0


def test_a_later_layer_with_the_wrong_tensor_gets_the_typed_error():
    pool = make_pool()
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        k = torch.randn(2, H, 3, D)
        cache.update(k, k, 0)
        with pytest.raises(TensorDtypeError):
            cache.update(k.double(), k.double(), 1)
        cache.update(k, k, 1)  # the step goes on with the right tensor
        cache.update(k, k, 2)
        assert cache.get_seq_length(2) == 3


@pytest.mark.parametrize("first", [True, False], ids=["first-layer", "later-layer"])
@pytest.mark.parametrize("which", ["key", "value"])
def test_kv_that_are_not_tensors_get_the_typed_error(first, which):
    pool = make_pool()
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        k = torch.randn(2, H, 3, D)
        if not first:
            cache.update(k, k, 0)
        layer = 0 if first else 1
        for bad in (None, [[1.0]], k.numpy()):
            args = (bad, k) if which == "key" else (k, bad)
            with pytest.raises(TensorShapeError):
                cache.update(*args, layer)
        cache.update(k, k, layer)  # the step goes on with tensors
        assert cache.get_seq_length(layer) == 3


def test_grad_requiring_kv_do_not_drag_the_pool_into_autograd():
    pool = make_pool()
    w = torch.ones((), requires_grad=True)
    with KVPoolCache(pool) as cache:
        for t in (3, 1):
            for layer in range(LAYERS):
                k = torch.randn(1, H, t, D) * w
                got_k, _ = cache.update(k, k, layer)
                assert torch.equal(got_k[:, :, -t:], k.detach())
    assert not any(t.requires_grad for _, t in pool.named_tensors())


def test_extend_host_is_extend_without_the_tensor():
    a, b = make_pool(), make_pool()
    for pool in (a, b):
        scramble(pool)
    ha, hb = a.open(2), b.open(2)
    for n in (5, 1, 1, 4):
        slots = a.extend(ha, n).slots
        assert np.array_equal(b._extend_host(hb, n), slots)
    out = np.full(2, -1, dtype=np.int64)  # a decode step's slots written into the caller's array
    for _ in range(3):
        slots = a.extend(ha, 1).slots
        assert b._extend_host(hb, 1, out) is out and np.array_equal(out, slots)
    assert np.array_equal(a.allocator.lengths(ha), b.allocator.lengths(hb))
    assert torch.equal(a.req_to_token, b.req_to_token)
    if hasattr(b, "fork"):
        b.fork(int(hb[0]), 1)  # shared pages: extend may copy on write, so only extend will do
        assert b._extend_host(hb, 1) is None
