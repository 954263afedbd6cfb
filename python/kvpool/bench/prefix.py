"""``python -m kvpool.bench prefix``: replay prefix-sharing traces on kvpool, SGLang and vLLM.

For each (scenario, page size, pool size) one seeded trace is generated and
replayed on every installed allocator that uses that page size (page 1: kvpool
and SGLang's RadixCache over its token allocator; page > 1: kvpool, SGLang's
RadixCache over its paged allocator and vLLM's KVCacheManager). Results go to
the terminal, a JSON file and a PNG plot, as for ``churn``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
from typing import Any

from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

from kvpool.bench import prefix_drivers, prefix_report, report
from kvpool.bench.churn import _list, parse_size
from kvpool.bench.prefix_runner import PrefixResult, replay
from kvpool.bench.prefix_trace import SCENARIOS, PrefixTraceConfig, generate
from kvpool.bench.runner import freeze_import_heap
from kvpool.bench.trace import Dist

# --quick: a small pool, few lanes and steps (tests and CI smoke runs; seconds).
QUICK_POOLS, QUICK_CONCURRENCY, QUICK_STEPS, QUICK_WARMUP = [1 << 16], 16, 24, 16
# ... and short prompts and outputs, so turns finish and prefixes repeat within those steps.
QUICK_LENGTHS = dict(system_len=Dist(256, 1024), user_len=Dist(16, 64), output=Dist(4, 24),
                     pressure_output=Dist(4, 24), turns=Dist(2, 4),
                     think_steps=Dist(1, 4), parallel_prompt=Dist(64, 512))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenarios", type=_list(str), default=list(SCENARIOS), help=f"subset of {','.join(SCENARIOS)}")
    p.add_argument("--pool-sizes", type=_list(parse_size), default=[1 << 20, 1 << 24],
                   help="pool sizes in slots (default 1M,16M)")
    p.add_argument("--concurrency", type=int, default=256, help="running sequences (default 256)")
    p.add_argument("--page-sizes", type=_list(int), default=[1, 16], help="default 1,16")
    p.add_argument("--allocators", type=_list(str), default=list(prefix_drivers.ALL),
                   help=f"subset of {','.join(prefix_drivers.ALL)}")
    p.add_argument("--steps", type=int, default=300, help="measured steps per run (300)")
    p.add_argument("--warmup", type=int, default=200, help="untimed steps first; the cache fills there (200)")
    p.add_argument("--repeats", type=int, default=1,
                   help="replays of each kvpool run; the one with the median mean is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse", default="",
                   help="a previous prefix JSON: its rows for allocators not run now join the report "
                        "(same seeded traces when the trace settings agree, which is checked)")
    p.add_argument("--quick", action="store_true", help="tiny pool and few steps: runs in seconds (tests, CI)")
    p.add_argument("--json", default="prefix.json", help="JSON output file, under --out ('' for none)")
    p.add_argument("--plot", default="prefix.png", help="PNG output file, under --out ('' for none)")
    report.add_out_argument(p)


def run(args: argparse.Namespace) -> tuple[list[PrefixResult], list[str]]:
    lengths: dict[str, Any] = {}
    if args.quick:
        args.pool_sizes, args.concurrency = QUICK_POOLS, QUICK_CONCURRENCY
        args.steps, args.warmup, args.repeats = QUICK_STEPS, QUICK_WARMUP, 1
        lengths = QUICK_LENGTHS
    classes, skipped = prefix_drivers.load(args.allocators)
    freeze_import_heap()
    for line in skipped:
        print(line, file=sys.stderr)
    plan = [(sc, ps, pool, [c for c in classes if c.supports(ps)])
            for sc in args.scenarios for ps in args.page_sizes for pool in args.pool_sizes]
    plan = [p for p in plan if p[3]]
    results: list[PrefixResult] = []
    bar = tqdm(total=sum(len(p[3]) for p in plan), desc="prefix", unit="run", file=sys.stderr)
    try:
        for sc, ps, pool, cls in plan:
            trace = generate(PrefixTraceConfig(sc, pool, args.concurrency, ps, steps=args.steps,
                                               warmup=args.warmup, seed=args.seed, **lengths))
            for c in cls:
                bar.set_postfix_str(f"{c.name} {sc} page={ps} pool={prefix_report.size(pool)}")
                reps = max(1, args.repeats) if c.name == "kvpool" else 1
                runs = [replay(c, trace) for _ in range(reps)]
                chosen = sorted(runs, key=lambda r: r.mean_us)[(len(runs) - 1) // 2]
                chosen.repeat_means_us = [r.mean_us for r in runs]
                results.append(chosen)
                bar.update(1)
            del trace
    finally:
        bar.close()
        gc.unfreeze()
    return results, skipped


TRACE_SETTINGS = ("concurrency", "steps", "warmup", "seed", "quick")


def reused(path: str, args: argparse.Namespace, running: set[str]) -> list[PrefixResult]:
    """Rows of an earlier run (same trace settings) for allocators this run does not replay."""
    import json

    with open(report.output_path(args.out, path)) as f:
        doc = json.load(f)
    theirs = doc["settings"]
    diff = [k for k in TRACE_SETTINGS if theirs.get(k) != getattr(args, k)]
    if diff:
        raise SystemExit(f"--reuse {path}: its traces differ ({', '.join(diff)}); rerun with the same settings")
    fields = {f.name for f in dataclasses.fields(PrefixResult)}
    return [PrefixResult(**{k: v for k, v in r.items() if k in fields}) for r in doc["results"]
            if r["allocator"] not in running]


def main(args: argparse.Namespace, machine: dict[str, Any]) -> int:
    results, skipped = run(args)
    if args.reuse:
        order = {n: i for i, n in enumerate(prefix_drivers.ALL)}
        results = sorted(results + reused(args.reuse, args, {r.allocator for r in results}),
                         key=lambda r: (SCENARIOS.index(r.scenario), r.page_size, r.num_slots,
                                        order.get(r.allocator, 99)))
    from kvpool.bench.prefix_drivers import sglang_prefix

    machine = dict(machine, sglang_tree_core=sglang_prefix.tree_core_backend() if sglang_prefix.available()[0] else None)
    ratios = prefix_report.prefix_ratios(results)
    print(prefix_report.prefix_table(results))
    print(prefix_report.parity_lines(ratios))
    if machine.get("sglang_tree_core"):
        print(f"SGLang's default UnifiedRadixCache TreeCore here: {machine['sglang_tree_core']}. 'sglang' rows "
              "use RadixCache (a Python tree), 'sglang-unified' rows UnifiedRadixCache with the TreeCore named "
              "under 'cache' (README: the torch 2.14 environment where the Rust TreeCore loads)")
    if args.quick:
        print("(quick run: tiny pool and few steps, a smoke test; the targets are for the full run)")
    bad = [r for r in results if not r.consistent]
    for r in bad:
        print(f"INCONSISTENT {r.allocator} {r.scenario} page={r.page_size} pool={r.num_slots}: "
              f"{r.held_pages_end} pages still held after the drain, wrote {r.handed_slots} slots, "
              f"expected {r.expected_slots - r.total_hit_tokens}", file=sys.stderr)
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    doc = {"benchmark": "prefix", "settings": settings, "machine": machine, "skipped": skipped,
           "ratios": ratios, "results": [r.to_json() for r in results]}
    if args.json:
        path = report.output_path(args.out, args.json)
        prefix_report.write_json(path, doc)
        print(f"wrote {path}")
    if args.plot:
        try:
            from kvpool.bench import plot

            path = report.output_path(args.out, args.plot)
            plot.prefix_plot(results, path)
            print(f"wrote {path}")
        except ImportError as exc:
            print(f"no plot: {exc} (pip install matplotlib)", file=sys.stderr)
    return 1 if bad else 0


__all__ = ["add_arguments", "main", "run"]
