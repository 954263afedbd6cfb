"""The churn benchmark's trace generator: seeded, within its distributions, within capacity."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.bench.churn.trace import ChurnTraceConfig, generate
from kvpool.bench.trace import Dist


def _arrays(trace):
    out = []
    for s in trace.steps + [trace.drain]:
        out += [s.release_lanes, s.release_lens, s.admit_lanes, s.admit_counts, s.decode_lanes, s.decode_lens]
    return out


def test_same_seed_same_trace_other_seed_other_trace():
    cfg = ChurnTraceConfig(num_slots=1 << 16, concurrency=32, page_size=16, steps=200, warmup=10, seed=7)
    a, b = generate(cfg), generate(cfg)
    assert all(np.array_equal(x, y) for x, y in zip(_arrays(a), _arrays(b)))
    c = generate(ChurnTraceConfig(num_slots=1 << 16, concurrency=32, page_size=16, steps=200, warmup=10, seed=8))
    assert not all(np.array_equal(x, y) for x, y in zip(_arrays(a), _arrays(c)))


configs = st.builds(
    ChurnTraceConfig,
    num_slots=st.sampled_from([1 << 12, 1 << 14, 1 << 16]),
    concurrency=st.integers(1, 48),
    page_size=st.sampled_from([1, 4, 16]),
    steps=st.integers(1, 120),
    warmup=st.integers(0, 8),
    prompt=st.sampled_from([Dist(1, 8), Dist(64, 512), Dist(100, 100), Dist(64, 4096)]),
    output=st.sampled_from([Dist(1, 4), Dist(16, 300), Dist(32, 32)]),
    seed=st.integers(0, 2**32 - 1),
)


@settings(max_examples=60, deadline=None)
@given(configs)
def test_trace_replays_within_distributions_and_capacity(cfg):
    trace = generate(cfg)
    P, C = cfg.page_size, cfg.concurrency
    length = np.full(C, -1)  # -1: lane free
    prompt = np.zeros(C, dtype=np.int64)
    decodes = np.zeros(C, dtype=np.int64)
    first_batch = np.zeros(C, dtype=bool)
    handed = 0
    assert len(trace.steps) == cfg.warmup + cfg.steps
    for t, s in enumerate(trace.steps + [trace.drain]):
        drain = t == len(trace.steps)
        # Releases: exactly the running lanes that finished; lengths as tracked.
        assert np.all(length[s.release_lanes] >= 0)
        assert np.array_equal(s.release_lens, length[s.release_lanes])
        for lane in s.release_lanes:
            if not drain and not first_batch[lane]:
                assert cfg.output.lo <= decodes[lane] <= cfg.output.hi  # output length from its distribution
            assert length[lane] == prompt[lane] + decodes[lane]
        length[s.release_lanes] = -1
        # Admissions: into free lanes, prompt lengths from the distribution (the pre-aged first
        # batch has already decoded part of its output).
        assert len(set(s.admit_lanes.tolist())) == len(s.admit_lanes)
        assert np.all(length[s.admit_lanes] == -1)
        for lane, n in zip(s.admit_lanes, s.admit_counts):
            hi = cfg.prompt.hi + (cfg.output.hi - 1 if t == 0 else 0)
            assert cfg.prompt.lo <= n <= hi
            first_batch[lane] = t == 0
            prompt[lane], decodes[lane], length[lane] = n, 0, n
        # Decodes: every running lane not admitted this step, one token each.
        expect = np.setdiff1d(np.flatnonzero(length >= 0), s.admit_lanes)
        assert np.array_equal(s.decode_lanes, expect[:0] if drain else expect)
        assert np.array_equal(s.decode_lens, length[s.decode_lanes])
        length[s.decode_lanes] += 1
        decodes[s.decode_lanes] += 1
        handed += s.slots
        # Capacity: never more running than lanes, never more pages than the pool has.
        live = length[length >= 0]
        assert len(live) <= C
        assert int(((live + P - 1) // P).sum()) <= cfg.usable_pages
        assert np.all(live <= cfg.max_context_len)
    assert np.all(length == -1)  # the drain released everyone
    assert handed == trace.total_slots
    assert trace.peak_reserved_pages <= cfg.usable_pages


def test_admission_fills_lanes_when_the_pool_has_room():
    trace = generate(ChurnTraceConfig(num_slots=1 << 22, concurrency=64, page_size=16, steps=50, warmup=0))
    assert trace.mean_batch() > 62  # only a request admitted this step skips decoding


def test_admission_stops_at_pool_capacity():
    cfg = ChurnTraceConfig(num_slots=1 << 14, concurrency=1024, page_size=16, steps=100, warmup=0,
                      prompt=Dist(500, 500), output=Dist(100, 100))
    trace = generate(cfg)
    per_request = -(-600 // 16)
    assert trace.peak_reserved_pages <= cfg.usable_pages
    assert max(len(s.decode_lanes) + len(s.admit_lanes) for s in trace.steps) == cfg.usable_pages // per_request


def test_dist_parse_and_errors():
    assert Dist.parse("64:4096") == Dist(64, 4096)
    assert Dist.parse("uniform:1:2") == Dist(1, 2)
    assert Dist.parse("512") == Dist(512, 512) == Dist.parse("fixed:512")
    for bad in ("", "a:b", "1:2:3", "0:5", "9:3"):
        with pytest.raises(ValueError):
            Dist.parse(bad)
    with pytest.raises(ValueError, match="not a whole number of pages of 16"):
        ChurnTraceConfig(num_slots=100, concurrency=1, page_size=16)
