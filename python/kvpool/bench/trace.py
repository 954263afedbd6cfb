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
    which declares ``num_slots`` and ``page_size`` and calls ``check_pool`` after its own checks."""

    num_slots: int  # pool size in slots, reserved page 0 included
    page_size: int

    def check_pool(self) -> None:
        if self.page_size < 1 or self.num_slots % self.page_size:
            raise ValueError(f"num_slots {self.num_slots} must be a multiple of page_size {self.page_size}")
        if self.num_slots // self.page_size < 2:
            raise ValueError("the pool needs at least one usable page besides the reserved page 0")

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
