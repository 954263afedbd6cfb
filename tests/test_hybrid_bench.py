"""The layer-group benchmarks: ``hybrid`` (prefix caching on a full + sliding-window pool, kvpool's
GroupedAllocator vs vLLM's hybrid coordinator) and ``hybrid-memory`` (bytes per request and
concurrent requests, groups vs every layer in full).

vLLM's driver runs when vLLM is installed and skips with the reason otherwise.
"""

from __future__ import annotations

import math

import pytest

from kvpool.bench import drivers, hybrid_memory
from kvpool.bench.hybrid import HYBRID, _config
from kvpool.bench.hybrid.trace import HybridTraceConfig, generate_hybrid, sliding_floor, split
from kvpool.bench.prefix.trace import PrefixTraceConfig, generate
from kvpool.bench.trace import Dist

SMALL = dict(system_len=Dist(256, 1024), user_len=Dist(16, 64), output=Dist(4, 24), pressure_output=Dist(4, 24),
             turns=Dist(2, 4), think_steps=Dist(1, 4), parallel_prompt=Dist(64, 512))


def _driver(name):
    cls = drivers.driver_class("hybrid", name)
    why = cls.skip_reason()
    if why is not None:
        if name == "kvpool":
            pytest.fail(why)
        pytest.skip(why)
    return cls


def _hybrid(scenario, pool=1 << 16, share=0.2, steps=40):
    base = dict(steps=steps, warmup=10, seed=1, step_prompt_tokens=1024, window=128, **SMALL)
    return _config(scenario, pool, 16, 16, share, base)


def test_the_sliding_group_holds_every_window_and_a_steps_prefill_and_its_share_of_the_rest():
    # 4 lanes, window 64 over page 16: at most 5 pages each, plus one of headroom; a 100-token prefill: 7.
    assert sliding_floor(4, 16, 64, 100) == 1 + 4 * 6 + 7
    assert split(200 * 16, 4, 16, 64, 100, 0.5) == 32 + 84
    assert split(200 * 16, 4, 16, 64, 100, 0.0) == 32
    with pytest.raises(ValueError, match="cannot hold"):
        split(33 * 16, 4, 16, 64, 100, 0.5)
    cfg = _hybrid("system")
    assert cfg.full_pages + cfg.sliding_pages == cfg.num_pages
    assert cfg.usable_pages == cfg.full_pages - 1  # admission budgets the full group
    with pytest.raises(ValueError, match="sliding_pages"):
        HybridTraceConfig("system", 1 << 16, 16, 16, step_prompt_tokens=1024, window=128, sliding_pages=10, **SMALL)


def test_a_steps_prefill_budget_bounds_what_it_admits():
    cfg = PrefixTraceConfig("system", 1 << 16, 16, 16, steps=40, warmup=10, seed=1, step_prompt_tokens=1200, **SMALL)
    trace = generate(cfg)
    admitted = [sum(len(g.prompt) for g in s.admit) for s in trace.steps]
    assert all(n <= 1200 or len(s.admit) == 1 for n, s in zip(admitted, trace.steps))
    unbounded = generate(PrefixTraceConfig("system", 1 << 16, 16, 16, steps=40, warmup=10, seed=1, **SMALL))
    assert max(sum(len(g.prompt) for g in s.admit) for s in unbounded.steps) > 1200  # the bound did something


@pytest.mark.parametrize("name", drivers.names("hybrid"))
@pytest.mark.parametrize("scenario", ["system", "chat", "parallel"])
def test_every_driver_ends_with_nothing_held_and_hits_repeats(name, scenario):
    cls = _driver(name)
    trace = generate_hybrid(_hybrid(scenario))
    r = HYBRID.replay(cls, trace)
    assert r.held_pages_end == 0, r
    assert r.consistent, r
    assert r.total_prompt_tokens == trace.prompt_tokens
    assert 0 < r.total_hit_tokens < r.total_prompt_tokens
    assert (r.full_pages, r.sliding_pages, r.window) == (trace.config.full_pages, trace.config.sliding_pages, 128)


@pytest.mark.parametrize("scenario", ["system", "chat"])
def test_without_eviction_kvpool_hits_exactly_what_vllms_hybrid_coordinator_hits(scenario):
    """Both take the longest L (a multiple of the page, at most len - 1) with the full group's pages
    for [0, L) and the sliding group's for [L - window + 1, L), and both keep the sliding pages the
    window passed as cache: on a pool where nothing is evicted, they hit the same tokens."""
    kv, vllm = _driver("kvpool"), _driver("vllm")
    trace = generate_hybrid(_hybrid(scenario, pool=1 << 18))
    a, b = HYBRID.replay(kv, trace), HYBRID.replay(vllm, trace)
    assert b.evicted_pages == 0
    assert a.total_hit_tokens == b.total_hit_tokens > 0


def test_memory_figures_are_what_the_pools_hold():
    # 1 full and 5 sliding layers, a 1024-token context in 256-token chunks, window 64, page 16.
    shape = hybrid_memory.Shape(layers=6, full_every=6, kv_heads=1, head_dim=8, dtype_bytes=2, window=64)
    tok = shape.token_layer_bytes
    assert tok == 32
    need = hybrid_memory.probe(shape, 1024, 256, 16)
    # After the first decode step the request holds 1025 tokens: 65 full pages; the window is
    # positions 961..1024, pages 60..64; during the last chunk (768..1023) the window before it
    # starts at 705 (page 44) and the chunk ends on page 63.
    assert need == {"full": 65, "sliding": 5, "sliding_peak": 20}
    budget = 400 * 16 * 6 * tok  # 400 all-full pages
    out = hybrid_memory.run(shape, [budget], 1024, 256, 16, 64)
    row = out["budgets"][0]
    assert row["all_full_pages"] == 400
    assert row["all_full"]["requests"] == (400 - 1) // 65
    full_pages, sliding_pages = row["full_pages"], row["sliding_pages"]
    assert full_pages * 16 * tok + sliding_pages * 16 * 5 * tok <= budget
    n = row["grouped"]["requests"]
    assert n == min((full_pages - 1) // 65, (sliding_pages - 1 - 15) // 5)
    assert row["grouped"]["bytes_per_request"] == (65 * 16 * tok + 5 * 16 * 5 * tok)
    assert math.isclose(row["bytes_ratio"], (65 + 25) / (65 * 6))
    assert out["per_request"]["ratio"] == row["bytes_ratio"]
