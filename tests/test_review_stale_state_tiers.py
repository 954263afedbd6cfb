"""Outside checks of a live ``KVPoolCache`` next to the pool's tiers, tensor-parallel pools and
request transfer: pool calls made between two of its steps (host-tier evictions that write back,
``evict``, ``cache`` of its rows then eviction pressure from another request, the disk tier) must
leave what the cache reads, and what the tiers keep for other prompts, exact. Each case is compared
with ``DynamicCache`` fed the same tokens (token-exact greedy, max abs logit diff < 1e-4) and ends
with ``pool.check()``.

Bounded: 2-layer, hidden-64 models (float32, CPU, one intra-op thread), a few dozen steps a case."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _hf_models import CACHE_KW, tiny_model  # noqa: I001  (skips without transformers)
from transformers import DynamicCache

from kvpool.integrations.transformers import KVPoolCache, pool_for_model

TOL = 1e-4
PROMPT = 6


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_hidden_layers=2)


def forward(model, cache, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, **{CACHE_KW: cache}).logits


class Pair:
    """A pool cache and a DynamicCache fed the same tokens (greedy on the DynamicCache's logits)."""

    def __init__(self, model, pool, batch=1, prefix=False, **kw):
        self.model, self.pool = model, pool
        self.dyn = DynamicCache(config=model.config)
        self.x = torch.randint(3, 90, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
        self.cache = KVPoolCache(pool, prefix_ids=self.x if prefix else None, **kw)
        self.worst = 0.0

    def steps(self, n):
        for _ in range(n):
            got = forward(self.model, self.cache, self.x)
            want = forward(self.model, self.dyn, self.x)
            assert torch.equal(got[:, -1].argmax(-1), want[:, -1].argmax(-1))
            self.worst = max(self.worst, (got - want).abs().max().item())
            self.x = want[:, -1].argmax(-1, keepdim=True)


def published(pool, tokens, seed=0):
    """Another request's prompt, K/V written and published (``close(cache=True)``); opened with
    ``open`` + ``extend(tokens=)``, so the pool has no shared page yet. Returns the K of its full
    pages per layer, to compare with what a later hit on the prompt reads."""
    n = len(tokens)
    hs = pool.open(1)
    ext = pool.extend(hs, n, tokens=tokens)
    g = torch.Generator().manual_seed(seed)
    for layer in range(pool.num_layers):
        k = torch.randn(n, pool.num_kv_heads, pool.head_dim, generator=g)
        pool.write(layer, ext.out_cache_loc, k, -k)
    full = (n - 1) // pool.page_size * pool.page_size
    want = [pool.read(layer, pool.slots(int(hs[0]))[:full])[0].clone() for layer in range(pool.num_layers)]
    pool.close(hs, cache=True)
    return want


def hit(pool, tokens):
    """Open ``tokens`` on the prefix cache (device or host tier); the K of its hit, and its handle."""
    hs, cached = pool.open_with_prefix(tokens, np.array([len(tokens)]))
    slots = pool.slots(int(hs[0]))[: int(cached[0])]
    return [pool.read(layer, slots)[0].clone() for layer in range(pool.num_layers)], hs


# -- 1. the host tier ---------------------------------------------------------------------------

def test_a_live_caches_step_that_evicts_runs_the_write_back_offloads_first(model):
    """A live cache's step whose extend evicts another prompt's cached pages (host tier,
    ``write_back``) queued their offloads and left them queued: the cache's short extend on a CPU
    pool (``_extend_host``) skipped ``_run_transfers``. The step then wrote its own K/V into the
    evicted page, and the next call that ran the transfers copied that to the host under the other
    prompt's hash: a later hit on that prompt read the cache's K/V (~2 off, silently)."""
    pool = pool_for_model(model, max_tokens=32, page_size=4, max_context_len=64, host_pages=16)
    assert pool.allocator.host_policy == "write_back"
    other = np.arange(10, 19, dtype=np.int64)  # 9 tokens: 2 full pages published
    want = published(pool, other)
    pair = Pair(model, pool)
    pair.steps(20)  # 26 tokens: 7 pages of 8 free, so a step evicts one of the other's pages
    assert pool.allocator.pending_offloads == 0, "a step left its evictions' offloads queued"
    assert pair.worst < TOL
    pair.cache.flush()  # (its tokens stored into the evicted page: what the bug copied to the host)
    pair.cache.close()
    got, hs = hit(pool, other)
    assert len(got[0]) == len(want[0]) == 8
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    pool.close(hs)
    pool.check()


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_host_tier_calls_between_steps_leave_a_live_cache_exact(model, policy):
    """Between decode steps: ``pool.cache(cache.handles)`` publishes the rows' full pages, another
    request's prompt hits them and its growth evicts (and writes back) cached pages, ``pool.evict``
    and a hit that loads from the host tier run. The rows' pages are theirs throughout (held pages
    are never evicted or offloaded), so the cache goes on exact without a counted call, and the
    prompts kept on the tiers read back as written."""
    pool = pool_for_model(model, max_tokens=64, page_size=4, max_context_len=64, host_pages=32,
                          host_policy=policy)
    other = np.arange(20, 29, dtype=np.int64)
    want = published(pool, other, seed=1)
    pair = Pair(model, pool, batch=2, prefix=True)  # (its rows know their prompt: cache() publishes)
    pair.steps(7)
    edits = pool._row_edits
    handles = pair.cache.handles
    pool.cache(handles)
    # Another request on the rows' own published prompt shares their full pages, grows, and is
    # closed with publish: its pages stay cached, the rows' held pages are untouched.
    tokens = pool.known_tokens(int(handles[0]))
    n = len(tokens)
    hs, cached = pool.open_with_prefix(tokens, np.array([n]))
    assert int(cached[0]) > 0
    pool.extend(hs, n - int(cached[0]) + 5)
    pool.close(hs, cache=True)
    pair.steps(5)
    # Pressure: a big request takes every free page (evicting what it must), then leaves.
    big = pool.open(1)
    pool.extend(big, int(pool.free_pages) * 4)
    pool.close(big)
    pool.evict(1 << 20)
    pair.steps(5)
    assert not pool._edited_since(edits, handles)  # (no counted call named the rows)
    loaded = pool.allocator.loaded_pages
    got, hs = hit(pool, other)  # from the host tier: the device copies were evicted
    assert pool.allocator.loaded_pages > loaded
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    pool.close(hs)
    pair.steps(4)
    assert pair.worst < TOL
    pair.cache.close()
    pool.check()


# -- 2. tensor-parallel pools -------------------------------------------------------------------

@pytest.fixture
def one_rank_group():
    import datetime

    import _dist
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():  # pragma: no cover - another module left one behind
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_dist.free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_a_cache_on_a_tp_pool_records_its_steps_and_crops(model, one_rank_group):
    """A ``KVPoolCache`` on a ``TPPool`` changed the allocator through the inner pool's private
    calls (``_extend_host`` for its steps, ``_truncate_keeping_prompts`` for ``crop``), reached by
    ``TPPool.__getattr__`` and so never recorded: the digest held none of its steps and the
    ``check_every`` check never ran. Pool calls through the wrapper (``truncate``) still reach the
    inner pool's counted calls, so the cache refuses to read past rows truncated that way."""
    from kvpool.distributed import TPPool
    from kvpool.errors import RowsChangedError

    inner = pool_for_model(model, max_tokens=256, page_size=4, max_context_len=64)
    tp = TPPool(inner, check_every=2)
    pair = Pair(model, tp, batch=2)
    calls = tp.calls
    pair.steps(10)
    assert tp._steps >= 2 and tp.calls > calls, "the cache's steps went around the digest"
    calls = tp.calls
    pair.cache.crop(-2)
    pair.dyn.crop(-2)
    assert tp.calls > calls, "crop went around the digest"
    pair.x = torch.randint(3, 90, (2, 1), generator=torch.Generator().manual_seed(3))
    pair.steps(4)
    assert pair.worst < TOL
    tp.truncate(pair.cache.handles, np.array([5, 5]))
    with pytest.raises(RowsChangedError, match="truncated through the pool"):
        forward(model, pair.cache, pair.x)
    pair.cache.close()
    inner.check()


def test_the_disk_tier_between_steps_leaves_a_live_cache_exact(model, tmp_path):
    """``DiskCache.store_new`` opens a scratch request on the rows' published pages (sharing them
    while it copies) and ``prefetch`` opens and extends one of its own, evicting under pressure:
    neither names the rows, and the cache goes on exact; what the disk kept reads back as written."""
    from kvpool.tiers import DiskCache, FileTier

    pool = pool_for_model(model, max_tokens=64, page_size=4, max_context_len=64, kv_events=True)
    disk = DiskCache(pool, FileTier(tmp_path, max_bytes=1 << 24), model="tiny")
    other = np.arange(30, 39, dtype=np.int64)
    want = published(pool, other, seed=2)
    pair = Pair(model, pool, batch=2, prefix=True)
    pair.steps(6)
    pool.cache(pair.cache.handles)
    assert disk.store_new() >= 3  # the other prompt's 2 full pages and the rows' published ones
    pair.steps(3)
    pool.clear_cache()  # (the other prompt now only on disk)
    assert disk.prefetch(other) == 2
    pair.steps(4)
    got, hs = hit(pool, other)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    pool.close(hs)
    pair.steps(3)
    assert pair.worst < TOL
    pair.cache.close()
    pool.check()


@pytest.mark.parametrize("call", ["swap", "fork"])
def test_counted_calls_with_handles_taken_before_deferred_steps(model, call):
    """``cache.handles`` taken, then decode steps inside a page the rows own (deferred: the pool's
    requests lag the cache), then ``swap_out``/``swap_in`` or another request's ``fork`` of the rows
    with those handles: the next step follows, and its catch-up stores the deferred tokens into the
    rows' new pages, so the cache goes on exact."""
    pool = pool_for_model(model, max_tokens=128, page_size=4, max_context_len=64, host_pages=32)
    pair = Pair(model, pool, batch=2)
    pair.steps(3)  # 8 tokens: two full pages
    h = pair.cache.handles
    pair.steps(3)  # 11 tokens: the last two deferred
    assert pair.cache.requests.deferred > 0
    if call == "swap":
        pool.swap_out(h)
        pool.swap_in(h)
    else:
        kids = pool.fork(int(h[0]), 1)
    pair.steps(8)
    assert pair.worst < TOL
    if call == "fork":
        pool.close(kids)
    pair.cache.close()
    assert pool.used_pages == 0
    pool.check()


def test_rows_truncated_past_pending_tokens_crop_as_the_error_says(model):
    """``pool.truncate`` of the rows, with handles taken before deferred steps, to fewer tokens
    than they held: the next step is refused, and the crop its error names (counting the deferred
    steps the pool never saw) goes on exact from the rows' length."""
    from kvpool.errors import RowsChangedError

    pool = pool_for_model(model, max_tokens=128, page_size=4, max_context_len=64)
    pair = Pair(model, pool, batch=2)
    pair.steps(3)
    h = pair.cache.handles
    pair.steps(3)  # 11 tokens, the pool's rows 9
    assert pair.cache.requests.deferred == 2
    pool.truncate(h, np.array([7, 7]))
    with pytest.raises(RowsChangedError, match=r"cache\.crop\(-4\)"):
        forward(model, pair.cache, pair.x)
    pair.cache.crop(-4)
    pair.dyn.crop(-4)
    pair.x = torch.randint(3, 90, (2, 1), generator=torch.Generator().manual_seed(5))
    pair.steps(8)
    assert pair.worst < TOL
    pair.cache.close()
    assert pool.used_pages == 0
    pool.check()
