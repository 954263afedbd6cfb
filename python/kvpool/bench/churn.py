"""``python -m kvpool.bench churn``: replay continuous-batching traces on every allocator.

For each (page size, pool size, concurrency) one trace is generated and replayed
on kvpool and on each installed baseline that uses that page size (page 1:
SGLang's token allocator; page > 1: SGLang's paged allocator and vLLM's
BlockPool). Results go to the terminal, a JSON file and a PNG plot.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

from kvpool.bench import drivers, report
from kvpool.bench.runner import ChurnResult, freeze_import_heap, replay
from kvpool.bench.trace import Dist, TraceConfig, generate
from kvpool.progress import progress

# --quick: tiny pools, few steps (tests and CI smoke runs; seconds, not minutes).
QUICK_POOLS, QUICK_CONCURRENCY, QUICK_STEPS, QUICK_WARMUP = [1 << 16, 1 << 18], [16, 64], 40, 8


def parse_size(text: str) -> int:
    """``1M`` -> 1048576, ``64K`` -> 65536, ``4096`` -> 4096."""
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 1M, 64K or 4096") from None


def _list(conv: Any) -> Any:
    return lambda text: [conv(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pool-sizes", type=_list(parse_size), default=[1 << 20, 1 << 22, 1 << 24],
                   help="pool sizes in slots (default 1M,4M,16M)")
    p.add_argument("--concurrency", type=_list(int), default=[64, 256, 1024],
                   help="running requests (default 64,256,1024)")
    p.add_argument("--page-sizes", type=_list(int), default=[1, 16], help="default 1,16")
    p.add_argument("--allocators", type=_list(str), default=list(drivers.ALL),
                   help=f"subset of {','.join(drivers.ALL)}")
    p.add_argument("--grid", choices=["full", "slices"], default="full",
                   help="full: every pool x concurrency; slices: pools at --ref-concurrency and "
                        "concurrencies at --ref-pool (what the plot shows)")
    p.add_argument("--ref-pool", type=parse_size, default=1 << 20, help="reference pool for ratios (1M)")
    p.add_argument("--ref-concurrency", type=int, default=256, help="reference concurrency for ratios (256)")
    p.add_argument("--target-repeats", type=int, default=3,
                   help="replays of the runs the targets read (reference point, and the largest pool at the "
                        "reference concurrency); the one with the median mean is reported (default 3)")
    p.add_argument("--steps", type=int, default=1500, help="measured decode steps per run")
    p.add_argument("--warmup", type=int, default=32, help="untimed steps first (memory is sampled there)")
    p.add_argument("--prompt", type=Dist.parse, default=Dist(64, 4096), help="prompt lengths LO:HI or N")
    p.add_argument("--output", type=Dist.parse, default=Dist(16, 1024), help="output lengths LO:HI or N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny pools and few steps: runs in seconds (tests, CI)")
    report.add_out_argument(p)
    p.add_argument("--json", default="churn.json", help="JSON output file, under --out ('' for none)")
    p.add_argument("--plot", default="churn.png", help="PNG output file, under --out ('' for none)")


def configs(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(page_size, pool, concurrency) triples to run, in order."""
    pairs = [(pool, c) for pool in args.pool_sizes for c in args.concurrency]
    if args.grid == "slices":
        pairs = [(p, c) for p, c in pairs if p == args.ref_pool or c == args.ref_concurrency]
    return [(ps, pool, c) for ps in args.page_sizes for pool, c in pairs]


def run(args: argparse.Namespace) -> tuple[list[ChurnResult], list[str]]:
    if args.quick:
        args.pool_sizes, args.concurrency = QUICK_POOLS, QUICK_CONCURRENCY
        args.steps, args.warmup = QUICK_STEPS, QUICK_WARMUP
        args.ref_pool, args.ref_concurrency = QUICK_POOLS[0], QUICK_CONCURRENCY[-1]
        args.target_repeats = 1
    classes, skipped = drivers.load(args.allocators)
    freeze_import_heap()
    for line in skipped:
        print(line, file=sys.stderr)
    # The target ratios hang on a few runs; on a shared host one unlucky replay can move them, so
    # those runs are replayed and the median kept (every repeat's mean stays in the JSON).
    targets = {(args.ref_pool, args.ref_concurrency), (max(args.pool_sizes), args.ref_concurrency)}
    plan = []
    for ps, pool, conc in configs(args):
        cls = [c for c in classes if c.supports(ps)]
        if cls:
            plan.append((ps, pool, conc, cls, max(1, args.target_repeats) if (pool, conc) in targets else 1))
    runs: dict[tuple[int, int], list[ChurnResult]] = {}
    traces: dict[int, Any] = {}
    bar = progress(total=sum(len(p[3]) * p[4] for p in plan), desc="churn", unit="run", file=sys.stderr)
    try:
        # Pass r replays every run that still wants an r-th repeat, so the repeats of the
        # target runs (1M and 16M, say) alternate instead of running back to back: drift on a
        # shared host (other jobs, frequency) then lands on both sides of a ratio alike.
        for rep in range(max((p[4] for p in plan), default=0)):
            for i, (ps, pool, conc, cls, repeats) in enumerate(plan):
                if rep >= repeats:
                    continue
                if i not in traces:
                    traces[i] = generate(TraceConfig(
                        num_slots=pool, concurrency=conc, page_size=ps, steps=args.steps,
                        warmup=args.warmup, prompt=args.prompt, output=args.output, seed=args.seed))
                for j, c in enumerate(cls):
                    bar.set_postfix_str(f"{c.name} page={ps} pool={report.size(pool)} conc={conc}")
                    runs.setdefault((i, j), []).append(replay(c, traces[i]))
                    bar.update(1)
    finally:
        bar.close()
        gc.unfreeze()  # hand the heap back, so interpreter exit frees it as usual
    results = [median_run(runs[key]) for key in sorted(runs)]
    return results, skipped


def median_run(runs: list[ChurnResult]) -> ChurnResult:
    """The run with the median mean step time, carrying every run's mean."""
    chosen = sorted(runs, key=lambda r: r.mean_us)[(len(runs) - 1) // 2]
    chosen.repeat_means_us = [r.mean_us for r in runs]
    chosen.consistent_all = all(r.consistent for r in runs)
    return chosen


def main(args: argparse.Namespace, machine: dict[str, Any]) -> int:
    results, skipped = run(args)
    ratios = report.churn_ratios(results, args.ref_pool, args.ref_concurrency)
    print(report.churn_table(results))
    print(report.ratio_lines(ratios))
    if args.quick:
        print("(quick run: tiny pools and few steps, a smoke test; the targets are for the full run)")
    bad = [r for r in results if not r.consistent]
    for r in bad:
        print(f"INCONSISTENT {r.allocator} page={r.page_size} pool={r.num_slots} conc={r.concurrency}: "
              f"handed {r.handed_slots} of {r.expected_slots} slots, {r.end_free_slots} of "
              f"{r.capacity_slots} free at the end", file=sys.stderr)
    settings = {k: (str(v) if isinstance(v, Dist) else v) for k, v in vars(args).items() if k != "func"}
    doc = {"benchmark": "churn", "settings": settings, "machine": machine, "skipped": skipped,
           "ratios": ratios, "results": [r.to_json() for r in results]}
    if args.json:
        path = report.output_path(args.out, args.json)
        report.write_json(path, doc)
        print(f"wrote {path}")
    if args.plot:
        try:
            from kvpool.bench import plot

            path = report.output_path(args.out, args.plot)
            plot.churn_plot(results, path, ref_pool=args.ref_pool, ref_concurrency=args.ref_concurrency)
            print(f"wrote {path}")
        except ImportError as exc:
            print(f"no plot: {exc} (pip install matplotlib)", file=sys.stderr)
    return 1 if bad else 0


__all__ = ["add_arguments", "configs", "main", "parse_size", "run"]
