"""The one timing loop every benchmark here uses, and the churn replay built on it.

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
from typing import Any, Callable

import numpy as np

from kvpool.bench.drivers.base import Driver
from kvpool.bench.trace import Trace


@dataclasses.dataclass
class Timing:
    ns: np.ndarray  # one wall-clock sample per timed call (perf_counter_ns)
    cpu_ns: np.ndarray  # the same calls in this thread's CPU time: blind to being descheduled
    items: int  # work units (slots, handles) the timed calls handled
    # What the clock calls themselves add to each sample (`clock_overhead`), taken off the
    # figures: a thread-CPU clock read is a system call (~0.6 us here), as long as a whole
    # kvpool step, so uncorrected the CPU mean came out above the wall mean.
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


@dataclasses.dataclass
class ChurnResult:
    allocator: str
    label: str
    version: str
    page_size: int
    num_slots: int
    concurrency: int
    steps: int
    mean_batch: float
    mean_us: float
    cpu_mean_us: float  # thread CPU time per step (mean): the noise-resistant twin of mean_us
    p50_us: float
    p99_us: float
    max_us: float
    ns_per_slot: float
    timed_slots: int
    meta_bytes: int  # peak (sampled at step boundaries) of python_bytes + native_bytes
    python_bytes: int  # tracemalloc: Python objects and numpy arrays the allocator side holds
    native_bytes: int  # torch storages / Rust memory at that peak
    handed_slots: int  # every slot handed out over the whole replay
    expected_slots: int  # what the trace asked for
    end_free_slots: int  # after the drain step
    capacity_slots: int  # usable slots (page 0 excluded)
    repeat_means_us: list[float] = dataclasses.field(default_factory=list)  # when replayed several times
    consistent_all: bool = True  # every repeat (not only the one reported) ended consistent

    @property
    def consistent(self) -> bool:
        ok = self.handed_slots == self.expected_slots and self.end_free_slots == self.capacity_slots
        return ok and self.consistent_all

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["consistent"] = self.consistent
        return d


def freeze_import_heap() -> None:
    """Move every object alive now (modules, torch, vLLM's import graph) out of the collector's
    reach, so the full collections ``replay`` makes walk only the benchmark's own objects."""
    gc.collect()
    gc.freeze()


def max_step_tokens(trace: Trace) -> int:
    return max([s.slots for s in trace.steps] + [1])


def warm_up(driver_cls: Any, trace: Any) -> tuple[Any, tuple[int, int], int]:
    """Build the driver and run the trace's warmup steps with memory sampled.

    Returns the driver, the peak (Python heap, native) bytes seen and the
    slots handed out. Shared by the churn and prefix replays."""
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


def replay(driver_cls: type[Driver], trace: Trace) -> ChurnResult:
    """Replay ``trace`` on a fresh allocator: warmup (memory sampled), measured steps (timed), drain."""
    cfg = trace.config
    driver, peak, handed = warm_up(driver_cls, trace)
    measured = trace.measured
    gc.collect()
    timing = time_loop(lambda i: driver.prepare(measured[i]), driver.run, len(measured))
    handed += timing.items + driver.run(driver.prepare(trace.drain))
    # Native memory only (tracemalloc is off now): the Rust/torch side at the end of the run.
    if driver.native_bytes() > peak[1]:
        peak = (peak[0], driver.native_bytes())
    s = timing.summary()
    return ChurnResult(
        allocator=driver.name,
        label=driver.label,
        version=driver.version(),
        page_size=cfg.page_size,
        num_slots=cfg.num_slots,
        concurrency=cfg.concurrency,
        steps=len(measured),
        mean_batch=trace.mean_batch(),
        mean_us=s["mean_us"],
        cpu_mean_us=s["cpu_mean_us"],
        p50_us=s["p50_us"],
        p99_us=s["p99_us"],
        max_us=s["max_us"],
        ns_per_slot=s["ns_per_item"],
        timed_slots=timing.items,
        meta_bytes=sum(peak),
        python_bytes=peak[0],
        native_bytes=peak[1],
        handed_slots=handed,
        expected_slots=trace.total_slots,
        end_free_slots=driver.free_slots(),
        capacity_slots=cfg.usable_pages * cfg.page_size,
    )
