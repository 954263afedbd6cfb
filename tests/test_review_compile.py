"""An engine's model step compiled with torch.compile, writing and reading through a CPU
KVPool: the K/V it stores equal an eager run's, in every grad mode (outside-style sweep)."""

from __future__ import annotations

import pytest
import torch

import kvpool

torch_dynamo = pytest.importorskip("torch._dynamo")

H, D = 2, 4


def small_pool() -> kvpool.KVPool:
    return kvpool.KVPool(2, H, D, dtype=torch.float32, page_size=1, num_pages=32, max_requests=2,
                         max_context_len=16)


def step(pool: kvpool.KVPool, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    for layer in range(pool.num_layers):
        pool.write(layer, loc, k * (layer + 1), v - layer)
    got_k, got_v = pool.read(1, loc)
    return got_k.sum() + got_v.sum()


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "enable_grad"])
def test_compiled_step_writes_pool_made_slots_as_eager_does_in_every_grad_mode(mode):
    # Under inference_mode, Dynamo traced write's PoolSlots lookup (its ring of the pool's
    # numpy slot arrays) and failed its own guard on them: "AssertionError: Guard failed on
    # the same frame it was created" from the first compiled write of out_cache_loc.
    ctx = getattr(torch, mode)
    eager, compiled = small_pool(), small_pool()
    torch_dynamo.reset()
    fn = torch.compile(step, backend="eager")
    he, hc = eager.open(1), compiled.open(1)
    for n in (3, 1, 2):
        k, v = torch.randn(n, H, D), torch.randn(n, H, D)
        le, lc = eager.extend(he, n).out_cache_loc, compiled.extend(hc, n).out_cache_loc
        with ctx():
            want, got = step(eager, le, k, v), fn(compiled, lc, k, v)
        assert torch.equal(want, got)
    for layer in range(2):
        assert torch.equal(eager.k_buffer(layer), compiled.k_buffer(layer))
        assert torch.equal(eager.v_buffer(layer), compiled.v_buffer(layer))
        assert not compiled.k_buffer(layer).is_inference()
    torch_dynamo.reset()


def _many_layers(hybrid: bool) -> kvpool.KVPool:
    if hybrid:
        return kvpool.KVPool(8, H, D, layer_types=["full_attention", "sliding_attention"] * 4, sliding_window=4,
                             dtype=torch.float32, page_size=4, num_pages=32, max_requests=2, max_context_len=32)
    return kvpool.KVPool(8, H, D, dtype=torch.float32, page_size=1, num_pages=64, max_requests=2,
                         max_context_len=32)


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
def test_a_compiled_step_over_many_layers_does_not_recompile_write_per_layer(hybrid):
    # Dynamo traced write/read past their slot check, specialising the rest on the layer
    # index and batch size: an 8-layer step compiled 30+ frames and hit Dynamo's
    # recompile_limit (8) warning for write and read. They now run as one disabled call.
    from torch._dynamo.utils import counters

    layers = 8
    pool, ref = _many_layers(hybrid), _many_layers(hybrid)

    def many(p, res, k, v):
        out = k.new_zeros(())
        for layer in range(p.num_layers):
            loc = res.for_layer(layer) if hybrid else res.out_cache_loc
            p.write(layer, loc, k + layer, v)
            got_k, _ = p.read(layer, loc)
            out = out + got_k.sum()
        return out

    torch_dynamo.reset()
    counters.clear()
    fn = torch.compile(many, backend="eager")
    h, hr = pool.open(1), ref.open(1)
    for n in (3, 1, 2, 4):
        k, v = torch.randn(n, H, D), torch.randn(n, H, D)
        assert torch.equal(fn(pool, pool.extend(h, n), k, v), many(ref, ref.extend(hr, n), k, v))
    assert counters["frames"]["total"] <= 2 * layers, dict(counters["frames"])
    for layer in range(layers):
        assert torch.equal(pool.k_buffer(layer), ref.k_buffer(layer))
        assert torch.equal(pool.v_buffer(layer), ref.v_buffer(layer))
    torch_dynamo.reset()


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
def test_write_and_read_frames_compile_once_for_every_layer_of_a_batch_size(hybrid):
    # The step's layer loop breaks the graph, so Dynamo compiles write and read as frames of
    # their own. Their break to the eager call guarded the layer index: torch 2.4 kept one
    # entry per layer for 0, 1 and 2 (it always specialises 0 and 1), torch 2.15 one for layer
    # 0 and one for the rest. One batch size, two steps: one entry each for all 8 layers.
    entries = getattr(torch_dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if entries is None:
        pytest.skip("this torch has no torch._dynamo.eval_frame._debug_get_cache_entry_list")
    from kvpool.hybrid_rows import HybridRows
    from kvpool.rows import RowsMixin

    pool = _many_layers(hybrid)

    def many(p, res, k, v):
        out = k.new_zeros(())
        for layer in range(p.num_layers):
            loc = res.for_layer(layer) if hybrid else res.out_cache_loc
            p.write(layer, loc, k + layer, v)
            out = out + p.read(layer, loc)[0].sum()
        return out

    torch_dynamo.reset()
    fn = torch.compile(many, backend="eager")
    h = pool.open(1)
    for _ in range(2):
        fn(pool, pool.extend(h, 3), torch.randn(3, H, D), torch.randn(3, H, D))
    cls = HybridRows if hybrid else RowsMixin
    got = {name: len(entries(getattr(cls, name).__code__)) for name in ("write", "read")}
    torch_dynamo.reset()
    assert got == {"write": 1, "read": 1}, got
