"""The shared-prefix demo engine under optimistic admission: preempted requests (a
continuation, or a forking request after its continuations) are recomputed and give
exactly the tokens a pool large enough never to preempt gives, with and without a host
tier; each forking request keeps exactly n - 1 continuations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
from kvpool.demo.model import ModelConfig, build_model
from kvpool.demo.requests import Request
from kvpool.demo.shared_prefix import ForkRequest, PrefixEngine, shared_prefix_requests

CFG = ModelConfig(vocab_size=96, hidden=32, layers=2, heads=4, kv_heads=2, max_positions=128, seed=3)


@pytest.fixture(scope="module")
def model():
    return build_model(CFG)


class CountingEngine(PrefixEngine):
    """Records each preempted request as (rid, rank, n)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.preempted = []

    def _preempt(self, waiting, running):
        victim = super()._preempt(waiting, running)
        self.preempted.append((victim.rid, victim.rank, victim.n))
        return victim


def serve(model, requests, *, pages, page_size, admission, host_pages=0, max_running=6):
    pool = kvpool.KVPool(CFG.layers, CFG.kv_heads, CFG.head_dim, dtype=torch.float32, page_size=page_size,
                         num_pages=pages + 1, max_requests=8, max_context_len=128, host_pages=host_pages)
    engine = CountingEngine(model, pool, max_running=max_running, admission=admission)
    with torch.inference_mode():
        stats = engine.run(requests)
    pool.check()
    assert pool.open_requests == 0
    out = {}
    for r in requests:
        assert len(r.forks) == r.n - 1, f"request {r.rid} asked for {r.n} continuations, has {1 + len(r.forks)}"
        assert sorted(k.rank for k in r.forks) == list(range(1, r.n))
        for k in [r, *r.forks]:
            assert len(k.output) == k.max_new_tokens
            out[(k.rid, k.rank)] = list(k.output)
    return out, stats, engine


def fork_requests(seed):
    return shared_prefix_requests(12, vocab_size=CFG.vocab_size, system_prompts=2, system_len=(8, 24),
                                  user_len=(2, 10), output_len=(4, 20), fork_share=0.4, fork_n=(2, 3), seed=seed)


@pytest.mark.parametrize("host_pages", [0, 24])
def test_a_preempted_continuation_is_recomputed_as_that_continuation(model, host_pages):
    ref, stats, _ = serve(model, fork_requests(0), pages=128, page_size=16, admission="reserve")
    assert stats.preemptions == 0
    reqs = fork_requests(0)
    tight = max(r.n * -(-r.final_length // 16) for r in reqs)  # the least the engine accepts
    got, stats, engine = serve(model, reqs, pages=tight, page_size=16, admission="optimistic",
                               host_pages=host_pages)
    assert any(rank > 0 for _, rank, _ in engine.preempted), "no continuation was preempted"
    assert got == ref
    # Generated tokens are the ones kept: a preempted request's thrown-away outputs count
    # once, as recomputed (they counted twice as generated, inflating tokens/s).
    assert stats.generated_tokens == sum(len(o) for o in got.values())
    assert stats.recomputed_tokens > 0


def test_generated_tokens_are_those_kept_under_preemption_in_the_default_engine(model):
    from kvpool.demo.engine import Engine
    from kvpool.demo.requests import synthetic_requests

    reqs = synthetic_requests(12, vocab_size=CFG.vocab_size, prompt_len=(4, 8), output_len=(8, 16), seed=0)
    pool = kvpool.KVPool(CFG.layers, CFG.kv_heads, CFG.head_dim, dtype=torch.float32, page_size=4,
                         num_pages=9, max_requests=8, max_context_len=32)
    with torch.inference_mode():
        stats = Engine(model, pool, max_running=6, admission="optimistic").run(reqs)
    assert stats.preemptions > 0 and stats.recomputed_tokens > 0
    assert stats.generated_tokens == sum(r.max_new_tokens for r in reqs) == sum(len(r.output) for r in reqs)
    assert stats.generated_tokens + stats.recomputed_tokens == stats.decode_tokens + stats.preemptions + len(reqs)


def test_a_preempted_forking_request_does_not_fork_again(model):
    # Two long requests admitted first (each admitted when its final length fits), then
    # one asking for two continuations: as all grow, the continuation is preempted first
    # (the newest), then its forking request.
    def requests():
        rng = np.random.default_rng(7)
        longs = [ForkRequest(rid=i, prompt=rng.integers(0, CFG.vocab_size, 8), max_new_tokens=new)
                 for i, new in ((0, 57), (1, 49))]
        return longs + [ForkRequest(rid=2, prompt=rng.integers(0, CFG.vocab_size, 4), max_new_tokens=17, n=2)]

    ref, stats, _ = serve(model, requests(), pages=64, page_size=4, admission="reserve", max_running=4)
    assert stats.preemptions == 0
    got, stats, engine = serve(model, requests(), pages=16, page_size=4, admission="optimistic", max_running=4)
    assert (2, 0, 2) in engine.preempted, engine.preempted
    assert got == ref


def test_reserve_admission_counts_the_copy_a_fork_family_makes(model):
    # "reserve" never preempts. A: prompt 6 (its last page holds 2 of 4), 2 continuations
    # of 8 tokens: 4 pages asked; B: 8 tokens, 2 pages. After A's fork, A and its
    # continuation share that partly filled page, and their first decode step copies it:
    # one page the reservation must keep, or B (admitted in the same step) takes it and
    # the decode step preempts.
    reqs = [ForkRequest(rid=0, prompt=np.arange(6), max_new_tokens=3, n=2),
            ForkRequest(rid=1, prompt=np.arange(40, 46), max_new_tokens=3)]
    _, stats, engine = serve(model, reqs, pages=4, page_size=4, admission="reserve", max_running=4)
    assert stats.preemptions == 0, engine.preempted


@pytest.mark.parametrize("cls", [Request, ForkRequest])
def test_requests_are_compared_by_identity(cls):
    # The engine finds a victim in its running list with list.remove. Dataclass equality compared
    # the numpy prompts and raised ValueError ("truth value of an array ... is ambiguous") for two
    # forks of one request (same rid, same prompt) on Python 3.13, for equal rids with distinct
    # prompts on every Python.
    prompt = np.arange(4)
    shared, fork, other = cls(2, prompt, 3), cls(2, prompt, 3, output=[5]), cls(2, np.arange(4), 3)
    running = [other, fork, shared]
    running.remove(shared)
    assert running == [other, fork] and shared not in running and shared == shared
    assert len({shared, fork, other}) == 3
