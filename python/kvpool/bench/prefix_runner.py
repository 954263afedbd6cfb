"""Replay of a prefix trace on one driver: the same timing loop as churn, plus hit and eviction counts."""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

from kvpool.bench.prefix_drivers.base import PrefixDriver
from kvpool.bench.prefix_trace import PrefixTrace
from kvpool.bench.runner import time_loop, warm_up


@dataclasses.dataclass
class PrefixResult:
    allocator: str
    label: str
    version: str
    backend: str  # which implementation served the cache (SGLang: its tree)
    scenario: str
    page_size: int
    num_slots: int
    concurrency: int
    steps: int
    mean_batch: float
    mean_us: float
    cpu_mean_us: float
    p50_us: float
    p99_us: float
    max_us: float
    prompt_tokens: int  # prompts of the sequences admitted in the measured steps (n per parallel group)
    hit_tokens: int  # of those, served by the prefix cache (not prefilled)
    total_prompt_tokens: int  # the same over the whole trace, cold start included
    total_hit_tokens: int
    evicted_pages: int
    cached_pages_end: int  # kept by the cache after the drain
    held_pages_end: int  # held by requests after the drain: must be 0
    meta_bytes: int
    python_bytes: int
    native_bytes: int
    handed_slots: int
    expected_slots: int  # slots the trace asks to be written (prefill without hits + decode)
    repeat_means_us: list[float] = dataclasses.field(default_factory=list)

    @property
    def hit_share(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def consistent(self) -> bool:
        return self.held_pages_end == 0 and self.handed_slots == self.expected_slots - self.total_hit_tokens

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["hit_share"] = self.hit_share
        d["consistent"] = self.consistent
        return d


def replay(driver_cls: type[PrefixDriver], trace: PrefixTrace) -> PrefixResult:
    """Warmup (memory sampled), measured steps (timed), drain; then the counters."""
    cfg = trace.config
    driver, peak, handed = warm_up(driver_cls, trace)
    measured = trace.measured
    gc.collect()
    # Hits are reported over the measured steps: the cache's steady state, not its cold start.
    p0, h0 = driver.prompt_tokens, driver.hit_tokens()
    timing = time_loop(lambda i: driver.prepare(measured[i]), driver.run, len(measured))
    p1, h1 = driver.prompt_tokens, driver.hit_tokens()
    handed += timing.items + driver.run(driver.prepare(trace.drain))
    if driver.native_bytes() > peak[1]:
        peak = (peak[0], driver.native_bytes())
    s = timing.summary()
    return PrefixResult(
        allocator=driver.name, label=driver.label, version=driver.version(), backend=driver.backend(),
        scenario=cfg.scenario, page_size=cfg.page_size, num_slots=cfg.num_slots, concurrency=cfg.concurrency,
        steps=len(measured), mean_batch=trace.mean_batch(),
        mean_us=s["mean_us"], cpu_mean_us=s["cpu_mean_us"], p50_us=s["p50_us"], p99_us=s["p99_us"],
        max_us=s["max_us"], prompt_tokens=p1 - p0, hit_tokens=h1 - h0,
        total_prompt_tokens=driver.prompt_tokens, total_hit_tokens=driver.hit_tokens(),
        evicted_pages=driver.evicted_pages(), cached_pages_end=driver.cached_pages(),
        held_pages_end=driver.held_pages(), meta_bytes=sum(peak), python_bytes=peak[0], native_bytes=peak[1],
        handed_slots=handed, expected_slots=trace.total_slots,
    )
