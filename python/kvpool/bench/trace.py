"""What every workload's trace shares: length distributions, the pool it is sized for, the step list.

A trace is what an engine's scheduler decides, step by step, precomputed before
anything is timed, so that every driver replays the same work. Each workload
(``churn/trace.py``, ``prefix/trace.py``) generates its own steps; they all
carry ``slots`` (slots the step hands out) and ``decode_lanes``, which is what
the runner and the reports read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from kvpool._core import MAX_CONTEXT_LEN, MAX_PAGES, MAX_REQUESTS


@dataclasses.dataclass(frozen=True)
class Dist:
    """Integer length distribution: uniform on [lo, hi] inclusive (lo == hi: fixed)."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not (1 <= self.lo <= self.hi):
            raise ValueError(f"length distribution needs 1 <= lo <= hi, got lo={self.lo} hi={self.hi}")

    @classmethod
    def parse(cls, text: str) -> Dist:
        """``"64:4096"`` / ``"uniform:64:4096"`` (uniform) or ``"512"`` / ``"fixed:512"``."""
        parts = text.split(":")
        if parts[0] in ("uniform", "fixed"):
            parts = parts[1:]
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            nums = []
        if len(nums) == 1:
            return cls(nums[0], nums[0])
        if len(nums) == 2:
            return cls(nums[0], nums[1])
        raise ValueError(f"bad length distribution {text!r}: use LO:HI (uniform) or N (fixed)")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.lo, self.hi + 1, size=n, dtype=np.int64)

    def __str__(self) -> str:
        return f"{self.lo}" if self.lo == self.hi else f"{self.lo}:{self.hi}"


class PoolShape:
    """The pool a trace config is sized for; mixed into each workload's frozen config dataclass,
    which declares ``num_slots``, ``page_size``, ``concurrency`` and ``max_context_len`` and calls
    ``check_pool`` first in its own checks. Its complaints name the bench flags that set the field,
    because a trace config is what ``python -m kvpool.bench`` builds from them (``Workload.check``
    reports them as usage errors)."""

    num_slots: int  # pool size in slots, reserved page 0 included
    page_size: int
    concurrency: int  # the pool's max_requests

    @property
    def max_context_len(self) -> int:
        """The longest request, prompt and output: each workload's config computes it from its lengths."""
        raise NotImplementedError

    @property
    def context_source(self) -> str:
        """What sets ``max_context_len``, for a complaint about it (a workload with length flags names them)."""
        return "the workload's request lengths"

    def check_pool(self) -> None:
        if self.page_size < 1 or self.num_slots % self.page_size:
            raise ValueError(f"--pool-sizes {self.num_slots} is not a whole number of pages of {self.page_size} "
                             "slots; give pool sizes that are multiples of every --page-sizes value")
        if self.num_slots // self.page_size < 2:
            raise ValueError(f"--pool-sizes {self.num_slots} holds {self.num_slots // self.page_size} page(s) of "
                             f"{self.page_size}; the pool needs a usable page besides the reserved page 0: give "
                             f"--pool-sizes >= {2 * self.page_size}")
        # The allocator's own bounds (kvpool._core), checked here so that a run stops before its
        # traces are generated, with the flag to change, instead of in a driver's constructor.
        if self.num_pages > MAX_PAGES:
            raise ValueError(f"--pool-sizes {self.num_slots} is {self.num_pages} pages of {self.page_size}; kvpool's "
                             f"allocator takes at most {MAX_PAGES} pages (page 0 included): give a smaller "
                             "--pool-sizes or a larger --page-sizes")
        if self.concurrency > MAX_REQUESTS:
            raise ValueError(f"--concurrency {self.concurrency} is more running requests than kvpool's allocator "
                             f"takes; give --concurrency in [1, {MAX_REQUESTS}]")
        if self.max_context_len > MAX_CONTEXT_LEN:
            raise ValueError(f"{self.context_source} make requests of up to {self.max_context_len} tokens; kvpool's "
                             f"allocator takes at most {MAX_CONTEXT_LEN} tokens per request: give shorter lengths")

    @property
    def num_pages(self) -> int:
        return self.num_slots // self.page_size

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1


@dataclasses.dataclass(frozen=True)
class Trace:
    """The steps of one trace: ``config.warmup`` untimed steps, then the measured ones, then a
    drain step that releases everything still running (replayed after measuring, untimed)."""

    config: Any  # the workload's config: a PoolShape with steps, warmup, concurrency
    steps: list[Any]
    drain: Any

    @property
    def measured(self) -> list[Any]:
        return self.steps[self.config.warmup :]

    @property
    def total_slots(self) -> int:
        return sum(s.slots for s in self.steps)

    def mean_batch(self) -> float:
        m = self.measured
        return float(np.mean([len(s.decode_lanes) for s in m])) if m else 0.0


__all__ = ["Dist", "PoolShape", "Trace"]
