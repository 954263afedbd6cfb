"""``python -m kvpool.bench prefix``: replay prefix-sharing traces on kvpool, SGLang and vLLM.

For each (scenario, page size, pool size) one seeded trace is generated and
replayed on every installed allocator that uses that page size (page 1: kvpool
and SGLang's RadixCache over its token allocator; page > 1: kvpool, SGLang's
RadixCache over its paged allocator and vLLM's KVCacheManager). Results go to
the terminal, a JSON file and a PNG plot, as for ``churn``.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from kvpool.bench import cli, command
from kvpool.bench.columns import ALLOCATOR, META_MIB, PAGE, POOL, STEP_TIMES, size
from kvpool.bench.plot import Bars, Panel
from kvpool.bench.prefix import figures
from kvpool.bench.prefix.result import PrefixResult
from kvpool.bench.prefix.trace import SCENARIOS, PrefixTrace, PrefixTraceConfig, generate
from kvpool.bench.trace import Dist
from kvpool.bench.workload import Case, Workload

# --quick: a small pool, few lanes and steps (tests and CI smoke runs; seconds).
QUICK_POOLS, QUICK_CONCURRENCY, QUICK_STEPS, QUICK_WARMUP = [1 << 16], 16, 24, 16
# ... and short prompts and outputs, so turns finish and prefixes repeat within those steps.
QUICK_LENGTHS = dict(system_len=Dist(256, 1024), user_len=Dist(16, 64), output=Dist(4, 24),
                     pressure_output=Dist(4, 24), turns=Dist(2, 4),
                     think_steps=Dist(1, 4), parallel_prompt=Dist(64, 512))


class CachingWorkload(Workload):
    """What the prefix-caching workloads (``prefix``, ``hybrid``) share: their cases, --quick,
    hit-rate ratios and plot panels."""

    plot_inches = (11.0, 3.4)
    quick_defaults = dict(pool_sizes=QUICK_POOLS, concurrency=QUICK_CONCURRENCY, steps=QUICK_STEPS,
                          warmup=QUICK_WARMUP, repeats=1)

    @staticmethod
    def case(config: Any, args: argparse.Namespace) -> Case:
        """One trace's case; only kvpool's run is repeated (--repeats)."""
        return Case(config, f"{config.scenario} page={config.page_size} pool={size(config.num_slots)}",
                    repeats=max(1, args.repeats), repeated=frozenset({"kvpool"}))

    def ratios(self, results: list[Any], args: argparse.Namespace) -> dict[str, Any]:
        return figures.prefix_ratios(results)

    def panels(self, args: argparse.Namespace) -> list[Panel]:
        def group(r: Any) -> tuple[str, int]:
            return (r.scenario, r.num_slots)

        def label(g: tuple[str, int]) -> str:
            return f"{g[0]}\n{size(g[1])}"

        return [Bars("mean_us", "µs per step (mean)", True, group, label),
                Bars("hit_share", "prefix-hit share of prompt tokens", False, group, label)]


class PrefixWorkload(CachingWorkload):
    name = "prefix"
    result_type = PrefixResult
    columns = [("scenario", lambda r: r.scenario), PAGE, POOL, ALLOCATOR, ("cache", lambda r: r.backend),
               *STEP_TIMES, ("hit % of prompt", lambda r: f"{100 * r.hit_share:.1f}"),
               ("pages evicted", lambda r: str(r.evicted_pages) if r.evicted_pages >= 0 else "n/a"),
               ("pages moved/step", lambda r: f"{r.moved_pages_per_step:.2f}" if r.host_pages else ""), META_MIB]
    plot_title = "Prefix caching: host time per step and hit share, kvpool vs SGLang and vLLM"
    reuse_settings = ("concurrency", "steps", "warmup", "seed", "quick")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--scenarios", type=cli.list_of(cli.one_of(list(SCENARIOS), "scenario")),
                       default=list(SCENARIOS), help=f"subset of {','.join(SCENARIOS)}")
        cli.add_replay_arguments(p, self.name, pools="1M,16M", steps=(300, "measured steps per run (300)"),
                                 warmup=(200, "untimed steps first; the cache fills there (200)"))
        p.add_argument("--concurrency", type=cli.count(1), default=256, help="running sequences (default 256)")
        p.add_argument("--repeats", type=cli.count(1), default=1,
                       help="replays of each kvpool run; the one with the median mean is reported")
        p.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                       help="kvpool's pools record no KV events (SlotAllocator(kv_events=False)), as SGLang "
                            "and vLLM replay here; their index then keys pages by the internal chain")
        p.add_argument("--reuse", default="",
                       help="a previous prefix JSON: its rows for allocators not run now join the report "
                            "(same seeded traces when the trace settings agree, which is checked)")

    def cases(self, args: argparse.Namespace) -> list[Case]:
        lengths: dict[str, Any] = QUICK_LENGTHS if args.quick else {}
        # Settings read back from a JSON (--reuse) or built by a caller may predate --no-kv-events.
        kv_events = getattr(args, "kv_events", True)
        return [self.case(PrefixTraceConfig(sc, pool, args.concurrency, ps, steps=args.steps, warmup=args.warmup,
                                            seed=args.seed, kv_events=kv_events, **lengths), args)
                for sc in args.scenarios for ps in args.page_sizes for pool in args.pool_sizes]

    def generate(self, config: Any) -> PrefixTrace:
        return generate(config)

    def ratio_lines(self, ratios: dict[str, Any]) -> str:
        return figures.parity_lines(ratios)

    def machine(self, machine: dict[str, Any]) -> dict[str, Any]:
        # Which TreeCore SGLang's default cache resolves to here: the 'sglang-unified' rows depend on it.
        from kvpool.bench.drivers import sglang_prefix

        core = sglang_prefix.tree_core_backend() if sglang_prefix.SGLangPrefixDriver.skip_reason() is None else None
        return dict(machine, sglang_tree_core=core)

    def notes(self, machine: dict[str, Any]) -> list[str]:
        if not machine.get("sglang_tree_core"):
            return []
        return [f"SGLang's default UnifiedRadixCache TreeCore here: {machine['sglang_tree_core']}. 'sglang' rows "
                "use RadixCache (a Python tree), 'sglang-unified' rows UnifiedRadixCache with the TreeCore named "
                "under 'cache' (docs/benchmarks.md: the torch 2.14 environment where the Rust TreeCore loads)"]


PREFIX = PrefixWorkload()
add_arguments = PREFIX.add_arguments
main = functools.partial(command.main, PREFIX)

__all__ = ["PREFIX", "CachingWorkload", "PrefixWorkload", "add_arguments", "main"]
