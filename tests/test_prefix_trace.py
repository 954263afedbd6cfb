"""The prefix benchmark's trace generator: seeded, scenario shapes, token bookkeeping, capacity."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.bench.prefix.trace import SCENARIOS, PrefixTraceConfig, generate
from kvpool.bench.trace import Dist

SMALL = dict(system_len=Dist(256, 1024), user_len=Dist(16, 64), output=Dist(4, 24), pressure_output=Dist(4, 24),
             turns=Dist(2, 4),
             think_steps=Dist(1, 4), parallel_prompt=Dist(64, 512))


def _cfg(scenario, **kw):
    base = dict(num_slots=1 << 16, concurrency=16, page_size=16, steps=60, warmup=10, seed=5)
    base.update(SMALL)
    base.update(kw)
    return PrefixTraceConfig(scenario, **base)


def _flat(trace):
    out = []
    for s in trace.steps + [trace.drain]:
        out += [s.release_lanes, s.release_lens, s.decode_lanes, s.decode_lens, s.decode_tokens]
        out += [x for g in s.admit for x in (g.lanes, *[q.tokens for q in g.seqs])]
    return out


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_same_seed_same_trace_other_seed_other_trace(scenario):
    a, b = generate(_cfg(scenario)), generate(_cfg(scenario))
    fa, fb = _flat(a), _flat(b)
    assert len(fa) == len(fb) and all(np.array_equal(x, y) for x, y in zip(fa, fb))
    c = generate(_cfg(scenario, seed=6))
    fc = _flat(c)
    assert len(fa) != len(fc) or not all(np.array_equal(x, y) for x, y in zip(fa, fc))


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_replay_bookkeeping_tokens_and_capacity(scenario, page_size):
    cfg = _cfg(scenario, page_size=page_size, num_slots=1 << 15)
    trace = generate(cfg)
    C, P = cfg.concurrency, cfg.page_size
    seqs = [None] * C
    length = np.full(C, -1)
    decoded = np.zeros(C, dtype=np.int64)
    assert len(trace.steps) == cfg.warmup + cfg.steps
    for t, s in enumerate(trace.steps + [trace.drain]):
        drain = t == len(trace.steps)
        assert np.array_equal(s.release_lens, length[s.release_lanes])
        for lane in s.release_lanes.tolist():
            assert drain or decoded[lane] == seqs[lane].out_len  # released right after its last decode
            assert length[lane] == seqs[lane].final_len or drain
            seqs[lane], length[lane] = None, -1
        for g in s.admit:
            assert g.n == (cfg.parallel_n if g.seqs[0].kind == "parallel" else 1)
            assert all(np.array_equal(q.prompt, g.prompt) for q in g.seqs)
            for lane, q in zip(g.lanes.tolist(), g.seqs):
                assert length[lane] == -1
                assert len(q.tokens) == q.prompt_len + q.out_len + 1
                assert cfg.output_dist.lo <= q.out_len <= cfg.output_dist.hi
                seqs[lane], length[lane], decoded[lane] = q, q.prompt_len, 0
        admitted = np.concatenate([g.lanes for g in s.admit]) if s.admit else np.zeros(0, dtype=np.int64)
        expect = np.setdiff1d(np.flatnonzero(length >= 0), admitted)
        assert np.array_equal(s.decode_lanes, expect[:0] if drain else expect)
        assert np.array_equal(s.decode_lens, length[s.decode_lanes])
        for lane, n, tok in zip(s.decode_lanes.tolist(), s.decode_lens.tolist(), s.decode_tokens.tolist()):
            assert seqs[lane].tokens[n] == tok  # feeds the token it sampled the step before
        length[s.decode_lanes] += 1
        decoded[s.decode_lanes] += 1
        live = [q for q in seqs if q is not None]
        # Admission keeps every running sequence's whole lifetime within the pool, without sharing.
        assert sum(-(-q.final_len // P) for q in live) <= cfg.usable_pages
        assert all(q.final_len <= cfg.max_context_len for q in live)
    assert np.all(length == -1)


def _groups(trace):
    return [g for s in trace.steps for g in s.admit]


def test_system_prompts_are_shared_and_few():
    cfg = _cfg("system", steps=120)
    heads = {}
    for g in _groups(generate(cfg)):
        p = g.prompt
        assert cfg.system_len.lo + cfg.user_len.lo <= len(p) <= cfg.system_len.hi + cfg.user_len.hi
        heads.setdefault(tuple(p[: cfg.system_len.lo].tolist()), 0)
        heads[tuple(p[: cfg.system_len.lo].tolist())] += 1
    assert len(heads) <= cfg.system_prompts and max(heads.values()) >= 3


def test_chat_turns_resend_the_whole_history():
    trace = generate(_cfg("chat", steps=150))
    seqs = [g.seqs[0] for g in _groups(trace)]
    followups = 0
    for q in seqs:
        earlier = [e for e in seqs if len(e.tokens) < q.prompt_len and np.array_equal(q.tokens[: len(e.tokens)], e.tokens)]
        if earlier:
            followups += 1
            prev = max(earlier, key=lambda e: len(e.tokens))
            user = q.prompt_len - len(prev.tokens)
            assert 16 <= user <= 64  # history (the previous turn's prompt and every token it sampled) + user turn
    assert followups >= 5


def test_parallel_groups_fork_four_ways():
    groups = _groups(generate(_cfg("parallel")))
    assert groups and all(g.n == 4 and len(set(g.lanes.tolist())) == 4 for g in groups)
    assert all(not np.array_equal(g.seqs[0].tokens, g.seqs[1].tokens) for g in groups)  # continuations diverge


def test_pressure_prefix_set_is_sized_from_the_pool():
    cfg = _cfg("pressure", steps=120)
    trace = generate(cfg)
    pool_tokens = cfg.usable_pages * cfg.page_size
    assert trace.distinct_prefix_tokens == pytest.approx(pool_tokens / cfg.cache_fraction, rel=0.15)
    kinds = {g.seqs[0].kind for g in _groups(trace)}
    assert kinds == {"system", "chat", "parallel"}


def test_config_errors():
    with pytest.raises(ValueError, match="unknown scenario"):
        PrefixTraceConfig("beam", 1 << 16)
    with pytest.raises(ValueError, match="not a whole number of pages of 16"):
        PrefixTraceConfig("system", 100, page_size=16)
    with pytest.raises(ValueError, match="cache_fraction"):
        PrefixTraceConfig("pressure", 1 << 16, cache_fraction=0)
