"""What ``python -m kvpool.bench <workload>`` does, for any workload: replay its cases, then report.

Every driver that can run here replays every case whose page size it
supports. The run goes in passes: pass r replays each (case, driver) that
still wants an r-th repeat, so the repeats of different cases alternate
instead of running back to back, and drift on a shared host (other jobs,
frequency) lands on both sides of a ratio alike. The run with the median mean
is reported, carrying every repeat's mean.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from typing import TYPE_CHECKING, Any

from kvpool.bench import drivers, report
from kvpool.bench.result import Result, median_run
from kvpool.bench.runner import freeze_import_heap
from kvpool.progress import progress

if TYPE_CHECKING:
    from kvpool.bench.drivers.base import Driver
    from kvpool.bench.workload import Case, Workload


def main(workload: Workload, args: argparse.Namespace, machine: dict[str, Any]) -> int:
    workload.check(args)
    classes, skipped = drivers.load(workload.name, args.allocators)
    for line in skipped:
        print(line, file=sys.stderr)
    results = run_cases(workload, workload.cases(args), classes)
    if workload.reuse_settings and args.reuse:
        results = with_reused(workload, args, results)
    return report.publish(workload, args, workload.machine(machine), results, skipped)


def run_cases(workload: Workload, cases: list[Case], classes: list[type[Driver]]) -> list[Result]:
    """Every case on every driver that supports its page size, in passes; rows in case, then driver order."""
    plan = [(case, [(c, case.repeats_of(c.name)) for c in classes if c.supports(case.config.page_size)])
            for case in cases]
    plan = [(case, runs) for case, runs in plan if runs]
    done: dict[tuple[int, int], list[Result]] = {}
    bar = progress(total=sum(n for _, runs in plan for _, n in runs), desc=workload.name, unit="run",
                   file=sys.stderr)
    freeze_import_heap()
    try:
        for rep in range(max((n for _, runs in plan for _, n in runs), default=0)):
            for i, (case, runs) in enumerate(plan):
                due = [(j, c) for j, (c, n) in enumerate(runs) if rep < n]
                if due:
                    _replay_case(workload, case, due, i, done, bar)
    finally:
        bar.close()
        gc.unfreeze()  # hand the heap back, so interpreter exit frees it as usual
    return [median_run(done[key]) for key in sorted(done)]


def _replay_case(workload: Workload, case: Case, due: list[tuple[int, type[Driver]]], i: int,
                 done: dict[tuple[int, int], list[Result]], bar: Any) -> None:
    # The trace is generated again in each pass instead of kept: it is seeded, so it is the same
    # trace, and only one trace's objects are alive for the collector while steps are timed.
    trace = workload.generate(case.config)
    for j, cls in due:
        bar.set_postfix_str(f"{cls.name} {case.label}")
        done.setdefault((i, j), []).append(workload.replay(cls, trace))
        bar.update(1)


def with_reused(workload: Workload, args: argparse.Namespace, results: list[Result]) -> list[Result]:
    """``results`` and the rows of an earlier run (``--reuse FILE``, same trace settings) for the
    allocators this run does not replay, sorted by case and then in registry order."""
    with open(report.output_path(args.out, args.reuse)) as f:
        doc = json.load(f)
    theirs = doc["settings"]
    diff = [k for k in workload.reuse_settings if theirs.get(k) != getattr(args, k)]
    if diff:
        raise SystemExit(f"--reuse {args.reuse}: its traces differ ({', '.join(diff)}); rerun with the same settings")
    running = {r.allocator for r in results}
    reused = [workload.result_type.from_json(r) for r in doc["results"] if r["allocator"] not in running]
    order = {n: i for i, n in enumerate(drivers.names(workload.name))}
    return sorted(results + reused, key=lambda r: (r.case, order.get(r.allocator, len(order))))


__all__ = ["main", "run_cases", "with_reused"]
