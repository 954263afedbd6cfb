"""Seeded continuous-batching traces, precomputed before anything is timed.

A trace is what an engine's scheduler decides, step by step: which requests
finish (and give their slots back), which are admitted (and prefill their
prompt), and which running requests decode one token. Every allocator driver
replays the same trace, so they all do the same work; the scheduler's own
bookkeeping (lanes, lengths) is done here, once, outside the timed region.

Model of one request: admitted at step t (prefill of ``prompt`` slots), it
decodes one token at each of the steps t+1 .. t+output, and is released at step
t+output+1. Admission is first-come first-served while a lane is free and the
pool can hold the request's whole lifetime (prompt + output, rounded up to
pages), so a request never runs out of room mid-decode (no preemption in the
trace). The first batch is admitted "pre-aged" (each request already part way
through its output, drawn uniformly) so measurement starts near steady state
instead of with every request finishing at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from kvpool.bench.trace import Dist, PoolShape, Trace

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class ChurnTraceConfig(PoolShape):
    num_slots: int  # pool size in slots, reserved page 0 included
    concurrency: int  # lanes: most requests running at once
    page_size: int = 1
    steps: int = 1000  # measured decode steps
    warmup: int = 64  # steps replayed before measuring (not timed)
    prompt: Dist = Dist(64, 4096)
    output: Dist = Dist(16, 1024)
    seed: int = 0

    def __post_init__(self) -> None:
        self.check_pool()
        if self.concurrency < 1 or self.steps < 1 or self.warmup < 0:
            raise ValueError("concurrency and steps must be >= 1, warmup >= 0")

    @property
    def max_context_len(self) -> int:
        return self.prompt.hi + self.output.hi

    @property
    def context_source(self) -> str:
        return f"--prompt {self.prompt} and --output {self.output}"


@dataclasses.dataclass(frozen=True)
class ChurnStep:
    """One scheduler step. Lanes are the engine's request rows (0 .. concurrency-1)."""

    release_lanes: np.ndarray  # finished requests, released first
    release_lens: np.ndarray  # their lengths (slots held)
    admit_lanes: np.ndarray  # admitted this step, in admission order
    admit_counts: np.ndarray  # prefill slots each
    decode_lanes: np.ndarray  # running requests that decode one token (ascending lane)
    decode_lens: np.ndarray  # their lengths before this step's token

    @property
    def slots(self) -> int:
        return int(self.admit_counts.sum()) + len(self.decode_lanes)


@dataclasses.dataclass(frozen=True)
class ChurnTrace(Trace):
    config: ChurnTraceConfig
    steps: list[ChurnStep]  # warmup steps, then measured steps
    drain: ChurnStep  # releases everything still running (run after measuring, untimed)
    peak_used_pages: int
    peak_reserved_pages: int


def _pages(lengths: np.ndarray, page_size: int) -> np.ndarray:
    return (lengths + page_size - 1) // page_size


class _Arrivals:
    """Endless seeded stream of (prompt, output); the head can be peeked before admission."""

    def __init__(self, cfg: ChurnTraceConfig, rng: np.random.Generator) -> None:
        self.cfg, self.rng = cfg, rng
        self.buf: Iterator[tuple[int, int]] = iter(())
        self.head: tuple[int, int] | None = None

    def peek(self) -> tuple[int, int]:
        if self.head is None:
            try:
                self.head = next(self.buf)
            except StopIteration:
                p = self.cfg.prompt.sample(self.rng, 1024)
                o = self.cfg.output.sample(self.rng, 1024)
                self.buf = iter(zip(p.tolist(), o.tolist()))
                self.head = next(self.buf)
        return self.head

    def pop(self) -> tuple[int, int]:
        head = self.peek()
        self.head = None
        return head


def generate(cfg: ChurnTraceConfig) -> ChurnTrace:
    """Precompute every step of the trace (deterministic for a given config)."""
    rng = np.random.default_rng(cfg.seed)
    arrivals = _Arrivals(cfg, rng)
    C, P = cfg.concurrency, cfg.page_size
    running = np.zeros(C, dtype=bool)
    length = np.zeros(C, dtype=np.int64)
    decoded = np.zeros(C, dtype=np.int64)
    output = np.zeros(C, dtype=np.int64)
    reserve = np.zeros(C, dtype=np.int64)  # pages held back for each request's whole lifetime
    free_lanes = list(range(C - 1, -1, -1))  # LIFO, like SGLang's request-row pool
    reserved = 0
    peak_used = peak_reserved = 0
    steps: list[ChurnStep] = []

    for t in range(cfg.warmup + cfg.steps):
        done = np.flatnonzero(running & (decoded >= output))
        rel_lens = length[done].copy()
        running[done] = False
        reserved -= int(reserve[done].sum())
        free_lanes.extend(done[::-1].tolist())

        admit: list[int] = []
        counts: list[int] = []
        while free_lanes:
            prompt, out = arrivals.peek()
            need = -(-(prompt + out) // P)
            if reserved + need > cfg.usable_pages:
                break  # FCFS: the head waits for room, nobody overtakes it
            arrivals.pop()
            lane = free_lanes.pop()
            age = int(rng.integers(0, out)) if t == 0 else 0  # pre-aged first batch
            admit.append(lane)
            counts.append(prompt + age)
            running[lane], length[lane], decoded[lane], output[lane] = True, prompt + age, age, out
            reserve[lane] = need
            reserved += need
        admit_lanes = np.array(admit, dtype=np.int64)

        decoding = running.copy()
        decoding[admit_lanes] = False
        dec = np.flatnonzero(decoding)
        dec_lens = length[dec].copy()
        length[dec] += 1
        decoded[dec] += 1

        peak_used = max(peak_used, int(_pages(length[running], P).sum()))
        peak_reserved = max(peak_reserved, reserved)
        steps.append(
            ChurnStep(done.astype(np.int64), rel_lens, admit_lanes, np.array(counts, dtype=np.int64), dec, dec_lens)
        )

    live = np.flatnonzero(running)
    drain = ChurnStep(live, length[live].copy(), _EMPTY, _EMPTY, _EMPTY, _EMPTY)
    return ChurnTrace(cfg, steps, drain, peak_used, peak_reserved)


__all__ = ["ChurnStep", "ChurnTrace", "ChurnTraceConfig", "generate"]
