"""The one timing loop every benchmark here uses, and the replay of one trace on one driver.

Only ``run`` is timed (``time.perf_counter_ns`` around it); ``prepare`` builds
the step's inputs outside the timed region. Garbage collection stays enabled,
as in engines; a full collection runs before each allocator is built and again
before its timed steps, so no run pays for the garbage of the one before.
The CLI freezes the import-time heap once (vLLM's engine freezes its start-up
heap too), which keeps those collections cheap.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool.bench.drivers.base import Driver
from kvpool.bench.trace import Trace


@dataclasses.dataclass
class Timing:
    ns: np.ndarray  # one wall-clock sample per timed call (perf_counter_ns)
    cpu_ns: np.ndarray  # the same calls in this thread's CPU time: blind to being descheduled
    items: int  # work units (slots, handles) the timed calls handled
    # What the clock calls themselves add to each sample (`clock_overhead`), taken off the
    # figures: a thread-CPU clock read can be a system call, as long as a whole kvpool step,
    # and left in it would put the CPU mean above the wall mean.
    overhead_ns: tuple[int, int] = (0, 0)

    def summary(self) -> dict[str, float]:
        wall, cpu = self.overhead_ns
        ns = np.maximum(self.ns.astype(np.float64) - wall, 0.0)
        if len(ns) == 0:
            return {"mean_us": 0.0, "p50_us": 0.0, "p99_us": 0.0, "max_us": 0.0, "ns_per_item": 0.0,
                    "cpu_mean_us": 0.0}
        cpu_ns = np.maximum(self.cpu_ns.astype(np.float64) - cpu, 0.0)
        return {
            "mean_us": float(ns.mean() / 1e3),
            "cpu_mean_us": float(cpu_ns.mean() / 1e3),
            "p50_us": float(np.percentile(ns, 50) / 1e3),
            "p99_us": float(np.percentile(ns, 99) / 1e3),
            "max_us": float(ns.max() / 1e3),
            "ns_per_item": float(ns.sum() / self.items) if self.items else 0.0,
        }


def clock_overhead(n: int = 1001) -> tuple[int, int]:
    """Median (wall, thread-CPU) ns that ``time_loop``'s clock calls add to one sample:
    the same calls, in the same order, around nothing."""
    wall = np.empty(n, dtype=np.int64)
    cpu = np.empty(n, dtype=np.int64)
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    for i in range(n):
        c0 = cpu_clock()
        t0 = clock()
        t1 = clock()
        cpu[i] = cpu_clock() - c0
        wall[i] = t1 - t0
    return int(np.median(wall)), int(np.median(cpu))


def time_loop(prepare: Callable[[int], Any], run: Callable[[Any], int], n: int) -> Timing:
    """Call ``run(prepare(i))`` for i in 0..n-1, timing only ``run``.

    Wall time is the figure; thread CPU time is kept beside it because on a
    shared host a step that gets descheduled for a few milliseconds swamps
    the mean of microsecond steps, and CPU time does not count that wait.
    (Everything timed runs on this thread: torch is held to one intra-op
    thread by the CLI, and kvpool releases the GIL but not the thread.)
    The clocks' own cost, measured just before, is taken off in ``summary``.
    """
    overhead = clock_overhead()
    samples = np.empty(n, dtype=np.int64)
    cpu = np.empty(n, dtype=np.int64)
    items = 0
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    for i in range(n):
        prep = prepare(i)
        c0 = cpu_clock()
        t0 = clock()
        k = run(prep)
        t1 = clock()
        cpu[i] = cpu_clock() - c0
        samples[i] = t1 - t0
        items += k
        del prep
    return Timing(samples, cpu, items, overhead)


def freeze_import_heap() -> None:
    """Move every object alive now (modules, torch, vLLM's import graph) out of the collector's
    reach, so the full collections ``measure`` makes walk only the benchmark's own objects."""
    gc.collect()
    gc.freeze()


def max_step_tokens(trace: Trace) -> int:
    return max([s.slots for s in trace.steps] + [1])


def warm_up(driver_cls: type[Driver], trace: Trace) -> tuple[Any, tuple[int, int], int]:
    """Build the driver and run the trace's warmup steps with memory sampled.

    Returns the driver, the peak (Python heap, native) bytes seen and the
    slots handed out."""
    gc.collect()
    tracemalloc.start()
    try:
        driver = driver_cls(trace.config, max_step_tokens(trace))
        peak = (0, 0)

        def sample() -> None:
            nonlocal peak
            py, native = tracemalloc.get_traced_memory()[0], driver.native_bytes()
            if py + native > sum(peak):
                peak = (py, native)

        sample()
        handed = 0
        for step in trace.steps[: trace.config.warmup]:
            handed += driver.run(driver.prepare(step))
            sample()
    finally:
        tracemalloc.stop()
    return driver, peak, handed


@dataclasses.dataclass
class Measurement:
    """One replay of a trace on a fresh driver, for the workload's result row to read."""

    driver: Any  # the driver after the drain: the row asks it for its end state
    trace: Trace
    summary: dict[str, float]  # Timing.summary() of the measured steps
    timed_items: int  # slots the measured steps handed out
    peak: tuple[int, int]  # peak (Python heap, native) metadata bytes
    handed: int  # slots handed out over the whole replay, warmup and drain included
    counted: dict[str, int]  # what the driver's counters() moved by over the measured steps


def measure(driver_cls: type[Driver], trace: Trace) -> Measurement:
    """Replay ``trace`` on a fresh driver: warmup (memory sampled), measured steps (timed), drain."""
    driver, peak, handed = warm_up(driver_cls, trace)
    measured = trace.measured
    gc.collect()
    before = driver.counters()
    timing = time_loop(lambda i: driver.prepare(measured[i]), driver.run, len(measured))
    after = driver.counters()
    handed += timing.items + driver.run(driver.prepare(trace.drain))
    # Native memory only (tracemalloc is off now): the Rust/torch side at the end of the run.
    if driver.native_bytes() > peak[1]:
        peak = (peak[0], driver.native_bytes())
    return Measurement(driver, trace, timing.summary(), timing.items, peak, handed,
                       {k: after[k] - before[k] for k in after})


__all__ = ["Measurement", "Timing", "clock_overhead", "freeze_import_heap", "max_step_tokens", "measure",
           "time_loop", "warm_up"]
