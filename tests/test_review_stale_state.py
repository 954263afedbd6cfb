"""Outside checks of state kept across steps: a consumer of the pool (``KVPoolCache``, the hybrid
cache, ``DecodeGraphRunner``) remembers its rows' length, pages or tables between calls, and a
public pool call made between two steps on those rows (truncate, close, reset, swap_out, and the
harmless ones: cache, evict, clear_cache, another request's fork) must be followed or refused with
a typed error, never read stale. Each case is compared with a from-scratch reference
(``DynamicCache`` fed the same tokens, or the step run directly on a twin pool).

Bounded: 2-4 layer, hidden-64 models (float32, CPU, one intra-op thread), a dozen steps a case."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _hf_hybrid_models import tiny  # noqa: I001  (skips without transformers)
from _hf_models import CACHE_KW, tiny_model
from transformers import DynamicCache

import kvpool
from kvpool import InvalidHandleError, KVPoolError, RequestSwappedOutError
from kvpool.cuda_graph import DecodeGraphRunner
from kvpool.integrations.transformers import KVPoolCache, pool_for_model
from kvpool.testing.toy_step import ToyDecode

TOL = 1e-4
PROMPT = 6  # tokens; page size 4, so the step to 10 tokens is inside a page the rows own


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models():
    return {"llama": tiny_model("llama", num_hidden_layers=2), "gemma3": tiny("gemma3")}


def forward(model, cache, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, **{CACHE_KW: cache}).logits


class Pair:
    """A pool cache and a DynamicCache fed the same tokens (greedy on the DynamicCache's logits)."""

    def __init__(self, model, pool, batch=2, layer_buffers=True):
        self.model, self.pool = model, pool
        self.cache = KVPoolCache(pool, layer_buffers=layer_buffers)
        self.dyn = DynamicCache(config=model.config)
        self.x = torch.randint(3, 90, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
        self.worst = 0.0

    def step(self):
        got = forward(self.model, self.cache, self.x)
        want = forward(self.model, self.dyn, self.x)
        self.worst = max(self.worst, (got - want).abs().max().item())
        self.x = want[:, -1].argmax(-1, keepdim=True)

    def steps(self, n):
        for _ in range(n):
            self.step()


def plain_pool(model, **kw):
    return pool_for_model(model, max_tokens=256, page_size=4, max_context_len=64, **kw)


# -- KVPoolCache: calls that change what its rows hold ------------------------------------------

@pytest.mark.parametrize("arch,layer_buffers", [("llama", True), ("llama", False), ("gemma3", True)])
def test_rows_truncated_through_the_pool_are_refused_not_read_stale(models, arch, layer_buffers):
    """``pool.truncate(cache.handles, n)`` shortens the rows the cache still counts as longer: its
    next step read positions the pool no longer holds (~0.2 off, silently). It is refused, with the
    pool as it was, and ``cache.crop`` to the rows' length goes on from there."""
    model = models[arch]
    pool = plain_pool(model) if arch == "llama" else pool_for_model(model, max_tokens=256, page_size=4,
                                                                      max_requests=4)
    p = Pair(model, pool, layer_buffers=layer_buffers)
    p.steps(4)  # 9 tokens
    h = p.cache.handles
    pool.truncate(h, np.full(2, 7))
    with pytest.raises(KVPoolError, match="truncated through the pool"):
        p.step()
    assert pool.lengths(h).tolist() == [7, 7]  # the refused step changed nothing
    pool.check()
    if arch == "llama":  # (DynamicCache's sliding layers do not crop)
        p.cache.crop(7 - p.cache.get_seq_length())
        p.dyn.crop(7 - p.dyn.get_seq_length())
        p.steps(8)
        assert p.worst <= TOL
    p.cache.close()
    assert pool.open_requests == 0
    pool.check()


@pytest.mark.parametrize("layer_buffers", [True, False])
@pytest.mark.parametrize("how", ["close", "reset"])
@pytest.mark.parametrize("reuse", [False, True])
def test_rows_closed_through_the_pool_are_refused_and_the_cache_still_closes(models, how, reuse, layer_buffers):
    """``pool.close(cache.handles)`` or ``pool.reset()`` under a live cache: its next step is
    refused at once (also a decode step inside a page, which would not call the pool), saying
    what happened; ``cache.close()`` then gives nothing back twice, and never closes the new
    request that took the old rows (generation counters)."""
    model = models["llama"]
    pool = plain_pool(model)
    p = Pair(model, pool, layer_buffers=layer_buffers)
    p.steps(4)  # 9 tokens: the next step's slot is in a page the rows own
    h = p.cache.handles
    rows = sorted(pool.rows(h).tolist())
    pool.close(h) if how == "close" else pool.reset()
    other = None
    if reuse:
        other = pool.open(2)
        pool.extend(other, 9)
        assert sorted(pool.rows(other).tolist()) == rows  # the old handles' rows, reopened
    with pytest.raises(InvalidHandleError, match="closed through the pool"):
        p.step()
    p.cache.close()
    p.cache.close()
    if reuse:
        assert pool.lengths(other).tolist() == [9, 9]
        pool.close(other)
    assert pool.open_requests == 0 and pool.used_pages == 0
    pool.check()


def test_hybrid_rows_closed_through_the_pool_are_refused_and_the_cache_still_closes(models):
    model = models["gemma3"]
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_requests=4)
    p = Pair(model, pool)
    p.steps(3)
    pool.close(p.cache.handles)
    other = pool.open(2)
    with pytest.raises(InvalidHandleError, match="closed through the pool"):
        p.step()
    p.cache.close()
    assert pool.is_open(int(other[0])) and pool.is_open(int(other[1]))
    pool.close(other)
    pool.check()


def test_linear_attention_rows_closed_through_the_pool_leave_the_new_holders_state_alone():
    """Qwen3-Next's linear-attention layer runs before the first attention layer extends: after
    ``pool.close(cache.handles)`` and a request that took the rows' state slots, the next forward
    is refused before the model gets (and updates in place) the old rows' states."""
    model = tiny("qwen3_next")
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_requests=4)
    p = Pair(model, pool)
    p.steps(3)
    h = p.cache.handles
    state_layers = [i for i in range(pool.num_layers) if pool.group(i).kind == "state"]
    old = {i: pool.state_slots(h, i).tolist() for i in state_layers}
    pool.close(h)
    other = pool.open(2)
    pool.extend(other, 5)
    assert any(set(pool.state_slots(other, i).tolist()) & set(old[i]) for i in state_layers)
    before = {(i, n): pool.state(i, n).clone() for i in state_layers for n in ("conv", "recurrent")}
    with pytest.raises(InvalidHandleError, match="closed through the pool"):
        p.step()
    p.cache.close()
    for (i, n), t in before.items():
        assert torch.equal(pool.state(i, n), t), f"layer {i}'s {n} state written after its rows closed"
    pool.close(other)
    pool.check()


@pytest.mark.parametrize("layer_buffers", [True, False])
def test_rows_swapped_out_are_refused_at_once_and_go_on_after_swap_in(models, layer_buffers):
    """A decode step inside a page the rows own makes no pool call: after ``pool.swap_out`` of
    the rows it must still be refused (as any step that extends is), and go on after swap_in."""
    model = models["llama"]
    pool = plain_pool(model, host_pages=64)
    p = Pair(model, pool, layer_buffers=layer_buffers)
    p.steps(4)
    h = p.cache.handles
    pool.swap_out(h)
    for _ in range(2):  # (refused again: nothing changed)
        with pytest.raises(RequestSwappedOutError, match="swap_in"):
            forward(model, p.cache, p.x)
    pool.swap_in(h)
    p.steps(8)
    assert p.worst <= TOL
    p.cache.close()
    assert pool.used_pages == 0
    pool.check()


@pytest.mark.parametrize("layer_buffers", [True, False])
def test_calls_that_leave_the_rows_alone_change_nothing(models, layer_buffers):
    """Publishing the rows' pages, evicting, clearing the prefix cache and another request's
    fork, truncate and close between steps: the rows hold what they held."""
    model = models["llama"]
    pool = plain_pool(model, host_pages=64)
    p = Pair(model, pool, layer_buffers=layer_buffers)
    other = pool.open(1)
    pool.extend(other, 5)
    for s in range(14):
        p.step()
        if s % 3 == 0:
            pool.cache(p.cache.handles)
            pool.evict(4)
        if s % 3 == 1:
            kid = pool.fork(int(other[0]), 1)
            pool.extend(kid, 3)
            pool.truncate(kid, np.array([2]))
            pool.close(kid)
        if s % 5 == 2:
            pool.swap_out(other)
            pool.swap_in(other)
            pool.clear_cache()
    assert p.worst <= TOL
    p.cache.close()
    pool.close(other)
    assert pool.used_pages == 0
    pool.check()


# -- DecodeGraphRunner: a runner kept across pool calls, against the step run directly --------

def twin_pools():
    pools = [kvpool.KVPool(2, 2, 8, num_pages=48, page_size=2, max_requests=8, max_context_len=16,
                           host_pages=32) for _ in range(2)]
    for p in pools:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for t in p.k_buffers + p.v_buffers:
                t.copy_(torch.randn(t.shape, generator=gen))
    return pools


def test_a_graph_runner_kept_across_pool_calls_matches_the_step_run_directly():
    """The runner remembers its static inputs, bucket views and the pool's null row; a pool call
    between runs (fork, truncate, swap, close and a row reused, reset) must change nothing
    in what a run computes or writes, compared with the step on a twin pool."""
    pools = twin_pools()
    runner = DecodeGraphRunner(pools[0], ToyDecode(pools[0]), max_batch_size=4)
    direct = ToyDecode(pools[1])
    live = [p.open(3) for p in pools]
    for p, h in zip(pools, live):
        p.extend(h, np.array([3, 5, 2]))

    def edit(s, p, h):
        if s == 1:
            kid = p.fork(int(h[0]), 1)
            p.close(h[2:])
            return np.concatenate([h[:2], kid])
        if s == 2:
            p.truncate(h, np.array([2, 3, 1]))
        if s == 3:
            p.swap_out(h[1:2])
            p.swap_in(h[1:2])
        if s == 4:
            p.reset()
            h = p.open(2)
            p.extend(h, np.array([1, 4]))
        return h

    for s in range(6):
        live = [edit(s, p, h) for p, h in zip(pools, live)]
        inputs = []
        for p, h in zip(pools, live):
            slots = p.extend(h, 1).slots
            lens = p.lengths(h)
            inputs.append((np.full(len(h), 7 + s), lens - 1, p.rows(h), slots, lens))
        assert all(np.array_equal(a, b) for a, b in zip(*inputs))
        with torch.inference_mode():
            got = runner.run(*inputs[0])
            want = direct(*(torch.as_tensor(np.asarray(a, dtype=np.int64)) for a in inputs[1]))
        # (a bucket of 4 pads a batch of 3: matmuls of another shape round differently)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(pools[0].k_buffers + pools[0].v_buffers, pools[1].k_buffers + pools[1].v_buffers):
            # page 0 (slots 0-1): the padding's sink
            torch.testing.assert_close(a.reshape(-1, 16)[2:], b.reshape(-1, 16)[2:], rtol=1e-5, atol=1e-5)
