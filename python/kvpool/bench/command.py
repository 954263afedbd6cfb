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
import os
import sys
from typing import TYPE_CHECKING, Any

from kvpool.bench import drivers, report
from kvpool.bench.cli import UsageError
from kvpool.bench.result import Result, median_run
from kvpool.bench.runner import freeze_import_heap
from kvpool.progress import progress

if TYPE_CHECKING:
    from kvpool.bench.drivers.base import Driver
    from kvpool.bench.workload import Case, Workload


def main(workload: Workload, args: argparse.Namespace, machine: dict[str, Any]) -> int:
    workload.check(args)
    # --reuse is read and checked now, not after the run: a file it cannot take is a usage error
    # before minutes of replays, never a traceback (or a SystemExit) after them.
    reused = read_reuse(workload, args) if workload.reuse_settings and getattr(args, "reuse", "") else None
    classes, skipped = drivers.load(workload.name, args.allocators)
    for line in skipped:
        print(line, file=sys.stderr)
    results = run_cases(workload, workload.cases(args), classes)
    if reused is not None:
        results = with_reused(workload, args, results, reused)
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


def _not_strict(name: str) -> Any:
    # Python's json reads NaN and Infinity, which no JSON writer of this package emits (figures
    # are finite or null) and which would come out as null in the merged file.
    raise ValueError(f"{name} is not JSON (a figure is a finite number or null)")


def read_reuse(workload: Workload, args: argparse.Namespace) -> list[Result]:
    """The rows of ``--reuse FILE``, or ``UsageError`` saying why the file cannot join this run: not
    strict JSON, not a results file of this workload, other trace settings, or a row this workload's
    report cannot take."""
    path = os.path.join(args.out, args.reuse)  # an absolute name stays as it is
    where = f"--reuse {args.reuse}"
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f, parse_constant=_not_strict)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"{where}: cannot read {path!r} as JSON ({e}); give a {workload.name} run's JSON "
                         "file") from None
    if not (isinstance(doc, dict) and isinstance(doc.get("settings"), dict) and isinstance(doc.get("results"), list)):
        raise UsageError(f"{where}: not a results file (no 'settings' and 'results'); give a {workload.name} "
                         "run's JSON file")
    if doc.get("benchmark") != workload.name:
        raise UsageError(f"{where}: a {doc.get('benchmark')!r} run's file, not a {workload.name!r} run's; give "
                         f"a {workload.name} run's JSON file")
    theirs = doc["settings"]
    diff = [f"{k}: {theirs.get(k)!r} there, {getattr(args, k)!r} here" for k in workload.reuse_settings
            if theirs.get(k) != getattr(args, k)]
    if diff:
        raise UsageError(f"{where}: its traces differ ({'; '.join(diff)}); rerun with the same settings")
    names = drivers.names(workload.name)
    rows = []
    for i, row in enumerate(doc["results"]):
        try:
            if row["allocator"] not in names:
                raise ValueError(f"allocator {row['allocator']!r} is none of {','.join(names)}")
            r = workload.result_type.from_json(row)
            r.case  # noqa: B018 -- its trace must be one this workload names (sorting needs it)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UsageError(f"{where}: results[{i}] is not a {workload.name} row ({type(e).__name__}: {e}); "
                             f"give a {workload.name} run's JSON file") from None
        rows.append(r)
    return rows


def with_reused(workload: Workload, args: argparse.Namespace, results: list[Result],
                reused: list[Result] | None = None) -> list[Result]:
    """``results`` and the rows of an earlier run (``--reuse FILE``, same trace settings; ``reused``:
    its rows as ``read_reuse`` gave them) for the allocators this run does not replay, sorted by case
    and then in registry order."""
    if reused is None:
        reused = read_reuse(workload, args)
    running = {r.allocator for r in results}
    reused = [r for r in reused if r.allocator not in running]
    order = {n: i for i, n in enumerate(drivers.names(workload.name))}
    return sorted(results + reused, key=lambda r: (r.case, order.get(r.allocator, len(order))))


__all__ = ["main", "read_reuse", "run_cases", "with_reused"]
