"""The slowest single allocator calls of a prefix replay: every call of kvpool's prefix
driver timed on its own, for stalls a per-step mean hides (the index's key table growing
inside one ``cache()``, first-touch faults of fresh memory).

    python benchmarks/prefix_call_times.py --scenario tiered --slots 16M --steps 300

Prints, over the calls after the first step (the first one maps the pool's arrays): the max
and p99 / p99.9 of ``cache()`` and of all calls, the slowest three calls, and the time of
each ``cache()`` that grew the native metadata by more than 8 MiB (a table growth). This
VM's first-touch faulting is erratic: run it several times.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import numpy as np

from kvpool.bench.cli import count, parse_size
from kvpool.bench.drivers.kvpool_prefix import KVPoolPrefixDriver
from kvpool.bench.prefix.trace import SCENARIOS, PrefixTraceConfig, generate


class _Timed:
    """The allocator, with each method call timed into ``calls``: (seconds, step, name,
    metadata bytes grown)."""

    def __init__(self, inner: Any, calls: list[tuple[float, int, str, int]]) -> None:
        self.inner, self.calls, self.step = inner, calls, 0

    def __getattr__(self, name: str) -> Any:
        f = getattr(self.inner, name)
        if not callable(f):
            return f

        def timed(*args: Any, **kw: Any) -> Any:
            before = self.inner.metadata_bytes
            t0 = time.perf_counter()
            r = f(*args, **kw)
            t = time.perf_counter() - t0
            self.calls.append((t, self.step, name, self.inner.metadata_bytes - before))
            return r

        return timed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default="tiered", choices=SCENARIOS)
    p.add_argument("--slots", type=parse_size, default=1 << 24)
    p.add_argument("--page-size", type=count(1), default=1)
    p.add_argument("--steps", type=count(1), default=300)
    a = p.parse_args(argv)
    try:
        cfg = PrefixTraceConfig(scenario=a.scenario, num_slots=a.slots, page_size=a.page_size,
                                steps=a.steps, warmup=0)
    except ValueError as e:
        # (the trace names python -m kvpool.bench's flags)
        p.error(str(e).replace("--pool-sizes", "--slots").replace("--page-sizes", "--page-size"))
    trace = generate(cfg)
    d = KVPoolPrefixDriver(cfg)
    calls: list[tuple[float, int, str, int]] = []
    timed = _Timed(d.alloc, calls)
    d.alloc = timed
    gc.collect()
    gc.freeze()  # as the bench does: a full collection of the import heap is not the allocator's
    for step, s in enumerate(trace.steps):
        timed.step = step
        d.run(d.prepare(s))
    late = [c for c in calls if c[1] > 0]
    cache = np.array([c[0] for c in late if c[2] == "cache"]) * 1e3
    every = np.array([c[0] for c in late]) * 1e3
    grew = [(round(t * 1e3, 1), st) for t, st, name, db in late if name == "cache" and db > 8 << 20]
    print(f"{a.scenario}, {a.slots} slots, page {a.page_size}, {a.steps} steps, {len(calls)} calls")
    for label, ts in (("cache()", cache), ("all calls", every)):
        if len(ts):
            print(f"  {label}: max {ts.max():.1f} ms, p99 {np.percentile(ts, 99):.2f} ms, "
                  f"p99.9 {np.percentile(ts, 99.9):.2f} ms")
    print("  slowest:", [(f"{t * 1e3:.1f} ms", st, name) for t, st, name, _ in sorted(late, reverse=True)[:3]])
    print("  cache() calls that grew a table (ms, step):", grew)


if __name__ == "__main__":
    main()
