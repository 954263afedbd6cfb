"""A pool built and driven under another default device places every tensor where it says.

Engines load models inside ``with torch.device("cuda"):`` or after
``torch.set_default_device("cuda")``, and often build their KV pool there too. A factory call
that names no device (``torch.empty(shape)``) then allocates on that default: the host tier
in device memory, a pinned staging buffer refused, a runner's pad values on the GPU. Every
test here runs under the ``meta`` default, which holds no data: anything the library makes
without naming its device fails at once, on a CPU-only machine. The pools themselves are CPU
pools, so their tensors must all stay on the CPU and their contents must be exact.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import kvpool
from kvpool.cuda_graph import DecodeGraphRunner
from kvpool.testing.toy_step import ToyDecode
from kvpool.tiers import DiskCache, FileTier


@contextlib.contextmanager
def set_default_meta():
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


DEFAULTS = {"with torch.device": lambda: torch.device("meta"), "set_default_device": set_default_meta}
LAYERS, HEADS, DIM = 2, 2, 8


def kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HEADS, DIM, generator=g), torch.randn(n, HEADS, DIM, generator=g)


def all_on_cpu(pool):
    where = {name: t.device.type for name, t in pool.named_tensors()}
    assert set(where.values()) == {"cpu"}, where


@pytest.mark.parametrize("default", DEFAULTS)
@pytest.mark.parametrize("kw", [
    dict(layout="token"),
    dict(layout="paged", page_size=1),
    dict(host_pages=32),
    dict(host_pages=32, host_policy="write_through"),
], ids=["token", "paged-page1", "host-write_back", "host-write_through"])
def test_a_plain_pool_keeps_its_tensors_and_kv_on_its_own_device(default, kw):
    kw = {"page_size": 4, **kw}
    k, v = kv(9, 0)
    with DEFAULTS[default]():
        pool = kvpool.KVPool(LAYERS, HEADS, DIM, dtype=torch.float32, device="cpu", num_pages=64,
                             max_requests=4, max_context_len=64, **kw)
        h = pool.open(1)
        res = pool.extend(h, 9, tokens=np.arange(9))
        for layer in range(LAYERS):
            pool.write(layer, res.out_cache_loc, k, v)
        pool.cache(h)
        if "host_pages" in kw:  # the host tier's pages are host memory whatever the default
            assert dict(pool.named_tensors())["host_kv"].device.type == "cpu"
            pool.swap_out(h)
            pool.swap_in(h)
        child = pool.fork(h[0], 1)
        pool.truncate(child, [3])
        pool.close(child)
        got = [pool.read(layer, pool.slots(h[0])) for layer in range(LAYERS)]
        pool.close(h, cache=True)
        hit, cached = pool.open_with_prefix(np.arange(9), [9])
        pool.close(hit)
        pool.check()
    all_on_cpu(pool)
    assert int(cached[0]) == 8
    for gk, gv in got:
        assert gk.device.type == "cpu" and torch.equal(gk, k) and torch.equal(gv, v)


@pytest.mark.parametrize("default", DEFAULTS)
def test_a_hybrid_pool_keeps_its_tensors_on_its_own_device(default):
    k, v = kv(3, 1)
    with DEFAULTS[default]():
        pool = kvpool.KVPool(LAYERS, HEADS, DIM, dtype=torch.float32, device="cpu", num_pages=64, page_size=4,
                             max_requests=4, max_context_len=64, layer_types=["sliding_attention", "linear_attention"],
                             sliding_window=8, state_shapes={"conv": (3, 4)})
        h = pool.open(1)
        res = pool.extend(h, 3, tokens=np.arange(3))
        pool.write(0, res.for_layer(0), k, v)
        child = pool.fork(h[0])
        got = pool.read(0, pool.slots(child[0], 0))
        pool.close(child)
        pool.close(h, cache=True)
        pool.check()
    all_on_cpu(pool)
    assert torch.equal(got[0], k) and torch.equal(got[1], v)


@pytest.mark.parametrize("default", DEFAULTS)
def test_a_graph_runner_built_and_run_under_another_default(default):
    pools = [kvpool.KVPool(LAYERS, HEADS, DIM, dtype=torch.float32, device="cpu", num_pages=48, page_size=2,
                           max_requests=8, max_context_len=16) for _ in range(2)]
    outs = []
    for i, pool in enumerate(pools):
        step = ToyDecode(pool)  # the engine's model: built where the engine builds it
        h = pool.open(3)
        pool.extend(h, np.array([2, 3, 4]))
        res = pool.extend(h, 1)
        lens = pool.allocator.lengths(h)
        inputs = tuple(torch.as_tensor(np.asarray(a, dtype=np.int64), device="cpu")
                       for a in (np.array([5, 6, 7]), lens - 1, pool.rows(h), res.slots, lens))
        with DEFAULTS[default]() if i else contextlib.nullcontext():  # the first runs as usual
            runner = DecodeGraphRunner(pool, step, max_batch_size=4)
            outs.append(runner(*inputs))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(pools[0].k_buffers[0], pools[1].k_buffers[0])


@pytest.mark.parametrize("default", DEFAULTS)
def test_a_disk_cache_stages_through_host_memory(default, tmp_path):
    tokens = np.arange(100, 118, dtype=np.int32)
    k, v = kv(18, 2)
    src, dst = (kvpool.KVPool(LAYERS, HEADS, DIM, dtype=torch.float32, device="cpu", num_pages=32, page_size=4,
                              max_requests=4, max_context_len=64) for _ in range(2))
    h = src.open(1)
    res = src.extend(h, 18, tokens=tokens)
    for layer in range(LAYERS):
        src.write(layer, res.out_cache_loc, k, v)
    src.close(h, cache=True)
    tier = FileTier(tmp_path, 1 << 20)
    with DEFAULTS[default]():
        assert DiskCache(src, tier, model="m").store_new() == 4
        assert DiskCache(dst, tier, model="m").prefetch(tokens) == 4
        h, cached = dst.open_with_prefix(tokens, [18])
        got = dst.read(1, dst.slots(h[0])[:16])
        dst.close(h)
    assert int(cached[0]) == 16 and torch.equal(got[0], k[:16]) and torch.equal(got[1], v[:16])


@pytest.mark.parametrize("default", DEFAULTS)
def test_kvpoolcache_generates_the_same_tokens_under_another_default(default):
    from _hf_models import greedy, left_padded, tiny_model
    from transformers import DynamicCache

    from kvpool.integrations.transformers import KVPoolCache, pool_for_model

    model = tiny_model()
    ids, mask = left_padded([5, 7])
    want = greedy(model, ids, mask, 6, DynamicCache(config=model.config)).sequences
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_requests=4, max_context_len=64)
    with DEFAULTS[default]():
        got = greedy(model, ids, mask, 6, KVPoolCache(pool)).sequences
    assert torch.equal(got, want)
    all_on_cpu(pool)
