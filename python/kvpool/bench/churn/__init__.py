"""``python -m kvpool.bench churn``: replay continuous-batching traces on every allocator.

For each (page size, pool size, concurrency) one trace is generated and replayed
on kvpool and on each installed baseline that uses that page size (page 1:
SGLang's token allocator; page > 1: SGLang's paged allocator and vLLM's
BlockPool). Results go to the terminal, a JSON file and a PNG plot.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from kvpool.bench import cli, command
from kvpool.bench.churn import figures
from kvpool.bench.churn.result import ChurnResult
from kvpool.bench.churn.trace import ChurnTrace, ChurnTraceConfig, generate
from kvpool.bench.columns import ALLOCATOR, META_MIB, PAGE, POOL, STEP_TIMES, size
from kvpool.bench.plot import Lines, Panel
from kvpool.bench.trace import Dist
from kvpool.bench.workload import Case, Workload

# --quick: tiny pools, few steps (tests and CI smoke runs; seconds, not minutes).
QUICK_POOLS, QUICK_CONCURRENCY, QUICK_STEPS, QUICK_WARMUP = [1 << 16, 1 << 18], [16, 64], 40, 8
# The reference point when --ref-pool / --ref-concurrency are left out: these when the run has them.
REF_POOL, REF_CONCURRENCY = 1 << 20, 256


class ChurnWorkload(Workload):
    name = "churn"
    result_type = ChurnResult
    columns = [PAGE, POOL, ("conc", lambda r: str(r.concurrency)), ("batch", lambda r: f"{r.mean_batch:.0f}"),
               ALLOCATOR, *STEP_TIMES, ("ns/slot", lambda r: f"{r.ns_per_slot:.1f}"), META_MIB]
    versus_kvpool = [("÷ kvpool", "mean_us"), ("÷ kvpool (cpu)", "cpu_mean_us")]
    plot_title = "Host time per continuous-batching step: allocator + table update"
    plot_inches = (9.0, 3.2)
    quick_defaults = dict(pool_sizes=QUICK_POOLS, concurrency=QUICK_CONCURRENCY, steps=QUICK_STEPS,
                          warmup=QUICK_WARMUP, target_repeats=1)

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        cli.add_replay_arguments(p, self.name, pools="1M,4M,16M",
                                 steps=(1500, "measured decode steps per run"),
                                 warmup=(32, "untimed steps first (memory is sampled there)"))
        p.add_argument("--concurrency", type=cli.list_of(cli.count(1)), default=[64, 256, 1024],
                       help="running requests (default 64,256,1024)")
        p.add_argument("--grid", choices=["full", "slices"], default="full",
                       help="full: every pool x concurrency; slices: pools at --ref-concurrency and "
                            "concurrencies at --ref-pool (what the plot shows)")
        p.add_argument("--ref-pool", type=cli.parse_size, default=None,
                       help="reference pool for ratios, one of --pool-sizes (default 1M if run, else the smallest)")
        p.add_argument("--ref-concurrency", type=cli.count(1), default=None,
                       help="reference concurrency for ratios, one of --concurrency (default 256 if run, else "
                            "the largest)")
        p.add_argument("--target-repeats", type=cli.count(1), default=3,
                       help="replays of the runs the targets read (reference point, and the largest pool at the "
                            "reference concurrency); the one with the median mean is reported (default 3)")
        p.add_argument("--prompt", type=cli.dist, default=Dist(64, 4096), help="prompt lengths LO:HI or N")
        p.add_argument("--output", type=cli.dist, default=Dist(16, 1024), help="output lengths LO:HI or N")

    def check(self, args: argparse.Namespace) -> None:
        if args.ref_pool is None:
            args.ref_pool = REF_POOL if REF_POOL in args.pool_sizes else min(args.pool_sizes)
        if args.ref_concurrency is None:
            args.ref_concurrency = REF_CONCURRENCY if REF_CONCURRENCY in args.concurrency else max(args.concurrency)
        if args.ref_pool not in args.pool_sizes:
            raise cli.UsageError(f"--ref-pool {size(args.ref_pool)} is not a run pool size; give one of "
                                 f"--pool-sizes {','.join(size(p) for p in args.pool_sizes)}")
        if args.ref_concurrency not in args.concurrency:
            raise cli.UsageError(f"--ref-concurrency {args.ref_concurrency} is not a run concurrency; give one "
                                 f"of --concurrency {','.join(map(str, args.concurrency))}")
        super().check(args)

    def cases(self, args: argparse.Namespace) -> list[Case]:
        # The target ratios hang on a few runs; on a shared host one unlucky replay can move them, so
        # those runs are replayed and the median kept (every repeat's mean stays in the JSON).
        targets = {(args.ref_pool, args.ref_concurrency), (max(args.pool_sizes), args.ref_concurrency)}
        return [Case(ChurnTraceConfig(num_slots=pool, concurrency=conc, page_size=ps, steps=args.steps,
                                      warmup=args.warmup, prompt=args.prompt, output=args.output, seed=args.seed),
                     f"page={ps} pool={size(pool)} conc={conc}",
                     repeats=max(1, args.target_repeats) if (pool, conc) in targets else 1)
                for ps, pool, conc in configs(args)]

    def generate(self, config: Any) -> ChurnTrace:
        return generate(config)

    def ratios(self, results: list[Any], args: argparse.Namespace) -> dict[str, Any]:
        return figures.churn_ratios(results, args.ref_pool, args.ref_concurrency)

    def ratio_lines(self, ratios: dict[str, Any]) -> str:
        return figures.ratio_lines(ratios)

    def panels(self, args: argparse.Namespace) -> list[Panel]:
        ref_pool, ref_conc = args.ref_pool, args.ref_concurrency
        return [Lines("num_slots", lambda r: r.concurrency == ref_conc, f"pool size (slots), concurrency {ref_conc}"),
                Lines("concurrency", lambda r: r.num_slots == ref_pool, f"concurrency, pool {size(ref_pool)} slots")]


def configs(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(page_size, pool, concurrency) triples to run, in order."""
    pairs = [(pool, c) for pool in args.pool_sizes for c in args.concurrency]
    if args.grid == "slices":
        pairs = [(p, c) for p, c in pairs if p == args.ref_pool or c == args.ref_concurrency]
    return [(ps, pool, c) for ps in args.page_sizes for pool, c in pairs]


CHURN = ChurnWorkload()
add_arguments = CHURN.add_arguments
main = functools.partial(command.main, CHURN)
# The argument types of the bench commands (defined in cli.py), also importable from here.
parse_size, _list = cli.parse_size, cli.list_of

__all__ = ["CHURN", "ChurnWorkload", "add_arguments", "configs", "main", "parse_size"]
