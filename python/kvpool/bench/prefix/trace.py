"""Seeded prefix-sharing traces: what the scheduler decides, with the token ids it sees.

Every allocator replays the same trace. A step releases finished sequences,
admits groups (one prompt, ``n`` continuations: ``n = 4`` for parallel sampling,
1 otherwise) and decodes one token for every other running sequence. Token ids
are part of the trace, so prefix caches see exactly the same prompts and the
same sampled tokens (a chat turn resends the tokens an earlier turn produced).

Scenarios (``SCENARIOS``):

- ``system``: 8 shared system prompts of 1-4K tokens; each request is one of them
  plus a 50-500 token user turn; outputs 16-512 tokens.
- ``chat``: sessions of 2-8 turns; each turn resends the whole history (earlier
  prompts and outputs) plus a new 50-500 token user message; outputs 16-512.
- ``parallel``: unrelated 256-4096 token prompts, each forked into n = 4
  continuations of 16-512 tokens.
- ``pressure``: a mix of the three (half system-prompt requests, a quarter chat
  turns, a quarter parallel groups) whose system prompts come from a large set,
  Zipf-popular, sized so the pool holds about 30% of the distinct prefixes
  (``cache_fraction``): eviction decides the hit rate. Outputs are shorter
  (16-128), so requests turn over faster and the pool fills within the run.
- ``tiered``: the host-tier workload: half system-prompt requests from a
  Zipf-popular set sized so the device pool holds about 20% of the distinct
  prefixes (``tier_fraction``), half multi-turn chat sessions; short outputs
  (4-32), so each prefix comes back many times in a run. Drivers with a host tier get ``host_pages`` host pages, enough for
  every distinct prefix.

Model of one sequence: admitted at step t (prefill of its prompt), it decodes
one token at steps t+1 .. t+O, feeding the token sampled the step before, and is
released at step t+O+1 holding P+O slots. Its token array is the prompt, then the
O+1 sampled tokens (the last one is sampled but never fed, as in an engine).
Admission is first-come first-served while lanes are free and the pool could hold
every running sequence's whole lifetime without any sharing (so no allocator ever
has to preempt, whatever its hit rate).
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from kvpool.bench.trace import Dist, PoolShape, Trace

SCENARIOS = ("system", "chat", "parallel", "pressure", "tiered")
VOCAB = 32000
_EMPTY = np.zeros(0, dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class PrefixTraceConfig(PoolShape):
    scenario: str
    num_slots: int  # pool size in slots, reserved page 0 included
    concurrency: int = 256
    page_size: int = 1
    steps: int = 1000  # measured steps
    warmup: int = 200  # untimed steps first (the cache fills there)
    seed: int = 0
    system_prompts: int = 8
    system_len: Dist = Dist(1024, 4096)
    user_len: Dist = Dist(50, 500)
    output: Dist = Dist(16, 512)
    pressure_output: Dist = Dist(16, 128)  # pressure: shorter outputs, faster turnover
    turns: Dist = Dist(2, 8)
    think_steps: Dist = Dist(1, 32)  # steps between a chat turn's end and the next turn's arrival
    parallel_prompt: Dist = Dist(256, 4096)
    parallel_n: int = 4
    cache_fraction: float = 0.3  # pressure: pool tokens / distinct prefix tokens
    zipf_s: float = 1.0  # pressure: popularity skew of the system prompts
    tier_fraction: float = 0.2  # tiered: device pool tokens / distinct prefix tokens
    tiered_output: Dist = Dist(4, 32)  # tiered: short answers, so prefixes come back many times a run
    # Most prompt tokens admitted in one step (0: no bound), as a scheduler's token budget bounds a
    # step's prefill; a group bigger than it is admitted alone. A sliding-window group holds a prompt
    # whole for the step that prefills it, so its pool is sized by this bound.
    step_prompt_tokens: int = 0
    # kvpool's pools record KV events (its default; the driver drains them untimed). Without them
    # the index keys pages by its cheaper internal chain. SGLang and vLLM replay without events.
    kv_events: bool = True

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {self.scenario!r}; choose from {SCENARIOS}")
        self.check_pool()
        if self.concurrency < self.parallel_n or self.steps < 1 or self.warmup < 0:
            raise ValueError(f"concurrency must be >= parallel_n ({self.parallel_n}), steps >= 1, warmup >= 0")
        if not 0 < self.cache_fraction <= 1 or not 0 < self.tier_fraction <= 1:
            raise ValueError("cache_fraction and tier_fraction must be in (0, 1]")
        if self.step_prompt_tokens < 0:
            raise ValueError("step_prompt_tokens must be >= 0 (0: no bound)")

    @property
    def max_prompt_len(self) -> int:
        one = max(self.system_len.hi + self.user_len.hi, self.parallel_prompt.hi)
        chat = self.turns.hi * (self.user_len.hi + self.output_dist.hi + 1)
        return max(one, chat) if self.scenario in ("chat", "pressure", "tiered") else one

    @property
    def output_dist(self) -> Dist:
        """Output lengths of this scenario's sequences."""
        if self.scenario == "tiered":
            return self.tiered_output
        return self.pressure_output if self.scenario == "pressure" else self.output

    @property
    def host_pages(self) -> int:
        """Host pages (reserved page 0 included) of drivers with a host tier: the distinct
        prefixes of ``tiered`` (device pool / ``tier_fraction``) plus a device pool's worth."""
        return int(self.usable_pages / self.tier_fraction) + self.usable_pages + 1

    @property
    def max_context_len(self) -> int:
        return self.max_prompt_len + self.output_dist.hi


@dataclasses.dataclass(frozen=True)
class Seq:
    """One sequence: ``tokens`` = prompt, then the ``out_len + 1`` tokens it samples."""

    tokens: np.ndarray  # int64
    prompt_len: int
    out_len: int
    kind: str  # scenario kind that produced it: system / chat / parallel

    @property
    def prompt(self) -> np.ndarray:
        return self.tokens[: self.prompt_len]

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.out_len  # slots held when released


@dataclasses.dataclass(frozen=True)
class Group:
    """Sequences admitted together that share one prompt (n > 1: parallel sampling)."""

    lanes: np.ndarray
    seqs: tuple[Seq, ...]

    @property
    def prompt(self) -> np.ndarray:
        return self.seqs[0].prompt

    @property
    def n(self) -> int:
        return len(self.seqs)


@dataclasses.dataclass(frozen=True)
class PrefixStep:
    release_lanes: np.ndarray
    release_lens: np.ndarray  # slots each released sequence holds
    admit: tuple[Group, ...]
    decode_lanes: np.ndarray  # ascending
    decode_lens: np.ndarray  # length before this step's token
    decode_tokens: np.ndarray  # the token each decoding lane feeds (sampled the step before)

    @property
    def slots(self) -> int:
        return sum(g.n * len(g.prompt) for g in self.admit) + len(self.decode_lanes)

    @property
    def prompt_tokens(self) -> int:
        return sum(g.n * len(g.prompt) for g in self.admit)


@dataclasses.dataclass(frozen=True)
class PrefixTrace(Trace):
    config: PrefixTraceConfig
    steps: list[PrefixStep]
    drain: PrefixStep  # releases everything still running
    distinct_prefix_tokens: int  # pressure: tokens of the whole system-prompt set

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.steps)


class _Source:
    """Seeded stream of groups to admit (FCFS queue, chat turns re-queued after a think time)."""

    def __init__(self, cfg: PrefixTraceConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng([cfg.seed, 1])
        self.queue: deque[list[Seq]] = deque()
        self.later: list[tuple[int, int, list[Seq]]] = []  # (ready step, order, group)
        self.order = 0
        self.sessions: dict[int, int] = {}  # id(seq) -> turns left after it
        self.system: dict[int, np.ndarray] = {}
        if cfg.scenario in ("pressure", "tiered"):
            frac = cfg.cache_fraction if cfg.scenario == "pressure" else cfg.tier_fraction
            mean = (cfg.system_len.lo + cfg.system_len.hi) / 2
            self.num_system = max(cfg.system_prompts, int(cfg.usable_pages * cfg.page_size / frac / mean))
            ranks = np.arange(1, self.num_system + 1, dtype=np.float64)
            w = ranks ** -cfg.zipf_s
            self.popularity = np.cumsum(w / w.sum())
        else:
            self.num_system = cfg.system_prompts
        self.system_lens = np.random.default_rng([cfg.seed, 2]).integers(
            cfg.system_len.lo, cfg.system_len.hi + 1, size=self.num_system)

    def distinct_prefix_tokens(self) -> int:
        return int(self.system_lens.sum()) if self.cfg.scenario in ("system", "pressure", "tiered") else 0

    def _tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, VOCAB, size=n, dtype=np.int64)

    def _system_prompt(self, k: int) -> np.ndarray:
        # Each system prompt's tokens depend only on (seed, k): generated when first drawn.
        if k not in self.system:
            self.system[k] = np.random.default_rng([self.cfg.seed, 3, k]).integers(
                0, VOCAB, size=int(self.system_lens[k]), dtype=np.int64)
        return self.system[k]

    def _seq(self, prompt: np.ndarray, kind: str) -> Seq:
        out = int(self.cfg.output_dist.sample(self.rng, 1)[0])
        return Seq(np.concatenate([prompt, self._tokens(out + 1)]), len(prompt), out, kind)

    def _new_group(self) -> list[Seq]:
        cfg = self.cfg
        kind = cfg.scenario
        if kind == "pressure":
            kind = ("system", "system", "chat", "parallel")[int(self.rng.integers(0, 4))]
        elif kind == "tiered":
            kind = ("system", "chat")[int(self.rng.integers(0, 2))]
        user = self._tokens(int(cfg.user_len.sample(self.rng, 1)[0]))
        if kind == "system":
            if cfg.scenario in ("pressure", "tiered"):
                k = int(np.searchsorted(self.popularity, self.rng.random()))
            else:
                k = int(self.rng.integers(0, self.num_system))
            return [self._seq(np.concatenate([self._system_prompt(min(k, self.num_system - 1)), user]), "system")]
        if kind == "chat":
            seq = self._seq(user, "chat")
            self.sessions[id(seq)] = int(cfg.turns.sample(self.rng, 1)[0]) - 1
            return [seq]
        prompt = self._tokens(int(cfg.parallel_prompt.sample(self.rng, 1)[0]))
        return [self._seq(prompt, "parallel") for _ in range(cfg.parallel_n)]

    def finished(self, seq: Seq, step: int) -> None:
        """A chat turn ended: its session's next turn arrives after a think time."""
        left = self.sessions.pop(id(seq), 0)
        if left <= 0:
            return
        user = self._tokens(int(self.cfg.user_len.sample(self.rng, 1)[0]))
        nxt = self._seq(np.concatenate([seq.tokens, user]), "chat")
        self.sessions[id(nxt)] = left - 1
        ready = step + int(self.cfg.think_steps.sample(self.rng, 1)[0])
        self.later.append((ready, self.order, [nxt]))
        self.order += 1

    def tick(self, step: int) -> None:
        ready = sorted(x for x in self.later if x[0] <= step)
        if ready:
            self.later = [x for x in self.later if x[0] > step]
            self.queue.extend(g for _, _, g in ready)

    def peek(self) -> list[Seq]:
        if not self.queue:
            self.queue.append(self._new_group())
        return self.queue[0]

    def pop(self) -> list[Seq]:
        return self.queue.popleft()


def generate(cfg: PrefixTraceConfig) -> PrefixTrace:
    """Precompute every step (deterministic for a given config)."""
    src = _Source(cfg)
    C, P = cfg.concurrency, cfg.page_size
    seqs: list[Seq | None] = [None] * C
    length = np.zeros(C, dtype=np.int64)
    decoded = np.zeros(C, dtype=np.int64)
    reserve = np.zeros(C, dtype=np.int64)
    running = np.zeros(C, dtype=bool)
    free_lanes = list(range(C - 1, -1, -1))
    reserved = 0
    budget = cfg.usable_pages - C  # a page of headroom per lane (copy-on-write, paged over-estimates)
    steps: list[PrefixStep] = []
    for t in range(cfg.warmup + cfg.steps):
        done = np.flatnonzero(running & (decoded >= np.array([s.out_len if s else 0 for s in seqs])))
        rel_lens = length[done].copy()
        for lane in done.tolist():
            src.finished(seqs[lane], t)  # type: ignore[arg-type]
            seqs[lane] = None
        running[done] = False
        reserved -= int(reserve[done].sum())
        free_lanes.extend(done[::-1].tolist())
        src.tick(t)

        admit: list[Group] = []
        step_tokens = 0
        while True:
            group = src.peek()
            need = [-(-s.final_len // P) for s in group]
            step_tokens += group[0].prompt_len
            if admit and 0 < cfg.step_prompt_tokens < step_tokens:
                break  # the step's prefill budget is spent: the head waits for the next step
            if len(free_lanes) < len(group) or reserved + sum(need) > budget:
                if reserved == 0 and not admit and len(free_lanes) == C:
                    raise ValueError(f"a request of {sum(need)} pages never fits a pool of {cfg.usable_pages}")
                break  # FCFS: the head waits for room
            src.pop()
            lanes = np.array([free_lanes.pop() for _ in group], dtype=np.int64)
            for lane, s, n in zip(lanes.tolist(), group, need):
                seqs[lane] = s
                running[lane], length[lane], decoded[lane], reserve[lane] = True, s.prompt_len, 0, n
            reserved += sum(need)
            admit.append(Group(lanes, tuple(group)))
        admitted = np.concatenate([g.lanes for g in admit]) if admit else _EMPTY

        decoding = running.copy()
        decoding[admitted] = False
        dec = np.flatnonzero(decoding)
        dec_lens = length[dec].copy()
        dec_tokens = np.array([seqs[lane].tokens[n] for lane, n in zip(dec.tolist(), dec_lens.tolist())],  # type: ignore[union-attr]
                              dtype=np.int64)
        length[dec] += 1
        decoded[dec] += 1
        steps.append(PrefixStep(done.astype(np.int64), rel_lens, tuple(admit), dec, dec_lens, dec_tokens))

    live = np.flatnonzero(running)
    drain = PrefixStep(live, length[live].copy(), (), _EMPTY, _EMPTY, _EMPTY)
    return PrefixTrace(cfg, steps, drain, src.distinct_prefix_tokens())


__all__ = ["SCENARIOS", "Group", "PrefixStep", "PrefixTrace", "PrefixTraceConfig", "Seq", "generate"]
