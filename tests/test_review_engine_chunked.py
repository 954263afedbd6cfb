"""Outside check: the chunked-prefill engine of ``_chunked_engine.py`` on a plain ``KVPool``
with a host tier drives a real tiny transformers model (Llama, Qwen2 with q/k/v biases).

Requests share system prompts (prefix hits), follow-up turns extend finished requests'
prompt + output (hits on pages ``close(cache=True)`` published, decode pages included),
two ask for two continuations (``fork``; copy-on-write on page 4), one repeats a prompt
under another salt (a miss), and when pages run out the newest request is swapped to the
host tier and back, or recomputed when the host is full. A speculative variant feeds
draft tokens with the decode ones, publishes the draft pages and truncates the rejected
ones. The oracle: every generated token, and its logits, equal a cache-free forward of
the model over the whole sequence; the pool's check() and counters agree with the engine
after every step, and nothing is left once all requests close and the cache is cleared."""

from __future__ import annotations

import _chunked_engine as engines
import pytest
import torch
from _chunked_engine import ChunkedEngine, check_against_full_forward, check_drained, one_thread, workload  # noqa: F401  (one_thread: an autouse fixture)
from _hf_models import tiny_model  # noqa: I001  (skips without transformers)

import kvpool


def make_pool(model, ps, layout, num_pages, host_pages, policy, max_context_len=96) -> kvpool.KVPool:
    cfg = model.config
    return kvpool.KVPool(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
                         dtype=torch.float32, page_size=ps, num_pages=num_pages, layout=layout, max_requests=24,
                         max_context_len=max_context_len, host_pages=host_pages, host_policy=policy, hash_seed=11)


CONFIGS = [  # arch, page size, layout, read path, host policy, device pages, host pages
    ("llama", 1, "token", "table", "write_back", 70, 120),
    ("qwen2", 4, "paged", "page_table", "write_through", 19, 120),
    ("llama", 4, "token", "table", "write_back", 19, 5),  # the host fills: some preemptions recompute
]


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("arch,ps,layout,read,policy,num_pages,host_pages", CONFIGS,
                         ids=[f"{c[0]}-p{c[1]}-{c[2]}-{c[3]}-{c[4]}" for c in CONFIGS])
def test_chunked_engine_matches_full_forward(arch, ps, layout, read, policy, num_pages, host_pages, grad_mode):
    torch.manual_seed(0)
    model = tiny_model(arch, seed=3)
    mode = torch.no_grad() if grad_mode == "no_grad" else torch.inference_mode()
    with mode:
        pool = make_pool(model, ps, layout, num_pages, host_pages, policy)
        engine = ChunkedEngine(model, pool, read, seed=ps)
        reqs = workload(seed=5)
        engine.run(reqs)
        done = engine.finished
        assert sorted(r.rid for r in done)[:len(reqs)] == list(range(len(reqs)))
        assert len(done) == len(reqs) + 2 + 3  # every request, the two fork children, three follow-ups
        for r in done:
            assert len(r.out) == r.max_new
            check_against_full_forward(model, r)

        c = engine.counts
        assert c["forks"] == 2 and c["mixed_steps"] > 0 and c["chunks"] > len(done)
        assert c["swap_out"] > 0 and c["swap_in"] + c["dropped_swapped"] == c["swap_out"], c
        assert (c["recomputed"] > 0) == (host_pages < 10), c
        assert pool.hit_tokens > 0 and pool.host_hit_tokens > 0 and pool.stats().loaded_pages > 0
        assert [r.cached for r in done if r.salt == 1] == [0]
        follow = [r for r in done if r.parent is not None]
        # some follow-up turn hit pages past its first turn's prompt: decode pages a finished request published
        assert any(r.cached > len(r.parent.prompt) for r in follow), [(r.cached, len(r.parent.prompt)) for r in follow]

        check_drained(pool)
        assert kvpool.audit(model=model, pool=pool) == []


@pytest.mark.parametrize("device_path", [False, True], ids=["cpu_tables", "device_path"])
@pytest.mark.parametrize("ps,layout,read,num_pages", [(1, "paged", "page_table", 90), (4, "token", "table", 24)])
def test_speculative_chunked_engine_matches_full_forward(ps, layout, read, num_pages, device_path):
    torch.manual_seed(0)
    model = tiny_model("llama", seed=3)
    with torch.inference_mode():
        pool = make_pool(model, ps, layout, num_pages, 120, "write_back", max_context_len=128)
        if device_path:  # the table updates a CUDA pool runs (the core does not write the table itself)
            pool._table_np = None
        engine = engines.SpeculativeEngine(model, pool, read, seed=ps + 1)
        engine.run(workload(seed=5), max_steps=600)
        for r in engine.finished:
            assert len(r.out) == r.max_new
            check_against_full_forward(model, r)
        c = engine.counts
        assert c["spec"] > 0 and c["accepted"] > 0 and c["truncated"] > 0 and c["probes"] > 0, c
        probes = [r for r in engine.finished if r.probe_at is not None]
        assert any(r.cached > r.probe_at for r in probes), [(r.cached, r.probe_at) for r in probes]
        check_drained(pool)


@pytest.mark.parametrize("ps,num_pages,host_pages", [(4, 24, 120), (3, 30, 4)])
def test_rewinding_chunked_engine_matches_full_forward(ps, num_pages, host_pages):
    model = tiny_model("qwen2", seed=3)
    with torch.inference_mode():
        pool = make_pool(model, ps, "paged", num_pages, host_pages, "write_through", max_context_len=160)
        pool._table_np = None  # the device path of the table updates
        engine = engines.RewindingEngine(model, pool, "table", seed=ps, max_running=6)
        engine.run(workload(seed=7), max_steps=900)
        for r in engine.finished:
            assert len(r.out) == r.max_new
            check_against_full_forward(model, r)
        assert engine.counts["rewinds"] > 0 and engine.counts["forks"] == 2, engine.counts
        check_drained(pool)
