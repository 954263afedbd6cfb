"""``python -m kvpool.bench hybrid``: prefix caching on a pool of layer groups (full attention and a
sliding window), kvpool's GroupedAllocator vs vLLM's HybridKVCacheCoordinator, at equal memory.

For each (scenario, pool size) one seeded trace (``hybrid/trace.py``) is replayed on both: the hit
rate (a hit needs the full group's prefix and the sliding group's window before it, in both) and
the host time per step, with the same runner, table, JSON and plot as ``prefix``. vLLM's two groups
share one block pool of ``pool / page`` blocks; kvpool's get the same pages in all, split by
``hybrid.trace.split`` (each group's own pool).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import TYPE_CHECKING, Any

from kvpool.bench import cli, command
from kvpool.bench.columns import ALLOCATOR, META_MIB, PAGE, POOL, STEP_TIMES
from kvpool.bench.hybrid.trace import HybridTraceConfig, generate_hybrid, split
from kvpool.bench.prefix import QUICK_LENGTHS, CachingWorkload
from kvpool.bench.prefix.result import PrefixResult
from kvpool.bench.prefix.trace import SCENARIOS, PrefixTrace
from kvpool.bench.report import NO_BASELINE, or_none, ratio_line
from kvpool.bench.workload import Case

if TYPE_CHECKING:
    from kvpool.bench.runner import Measurement

QUICK_WINDOW = 256  # --quick prompts are 256-1100 tokens: a window shorter than most of them


@dataclasses.dataclass(kw_only=True)
class HybridResult(PrefixResult):
    window: int
    full_pages: int  # kvpool's full group (page 0 included); vLLM's pool is full_pages + sliding_pages
    sliding_pages: int

    @classmethod
    def workload_fields(cls, m: Measurement) -> dict[str, Any]:
        cfg = m.trace.config
        return dict(super().workload_fields(m), window=cfg.window, full_pages=cfg.full_pages,
                    sliding_pages=cfg.sliding_pages)


class HybridWorkload(CachingWorkload):
    name = "hybrid"
    result_type = HybridResult
    columns = [("scenario", lambda r: r.scenario), PAGE, POOL, ("window", lambda r: str(r.window)),
               ("kvpool pages full + sliding", lambda r: f"{r.full_pages} + {r.sliding_pages}"), ALLOCATOR,
               *STEP_TIMES, ("hit % of prompt", lambda r: f"{100 * r.hit_share:.1f}"), META_MIB]
    plot_title = "Hybrid prefix caching (full + sliding window): host time per step and hit share"
    quick_defaults = dict(CachingWorkload.quick_defaults, window=QUICK_WINDOW)

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--scenarios", type=cli.list_of(cli.one_of(list(SCENARIOS), "scenario")),
                       default=["system", "chat", "pressure"],
                       help=f"subset of {','.join(SCENARIOS)} (default system,chat,pressure)")
        cli.add_replay_arguments(p, self.name, pools="1M,4M", steps=(300, "measured steps per run (300)"),
                                 warmup=(200, "untimed steps first; the cache fills there (200)"), pages="16")
        p.add_argument("--concurrency", type=cli.count(1), default=256, help="running sequences (default 256)")
        p.add_argument("--window", type=cli.count(1), default=1024,
                       help="the sliding group's window, the token itself included (default 1024: Gemma 3)")
        p.add_argument("--step-prompt-tokens", type=cli.count(1), default=8192,
                       help="most prompt tokens admitted per step (default 8192)")
        p.add_argument("--sliding-cache-share", type=cli.fraction(zero=True), default=0.35,
                       help="of the pages left once the sliding group can hold every window and a step's "
                            "prefill, the share it gets (default 0.35; the rest is the full group's, for "
                            "running sequences and cache; benchmarks/results has the hit rates at others)")
        p.add_argument("--repeats", type=cli.count(1), default=1,
                       help="replays of each kvpool run; the one with the median mean is reported")

    def cases(self, args: argparse.Namespace) -> list[Case]:
        lengths: dict[str, Any] = QUICK_LENGTHS if args.quick else {}
        base = dict(steps=args.steps, warmup=args.warmup, seed=args.seed,
                    step_prompt_tokens=args.step_prompt_tokens, window=args.window, **lengths)
        return [self.case(_config(sc, pool, args.concurrency, ps, args.sliding_cache_share, base), args)
                for sc in args.scenarios for ps in args.page_sizes for pool in args.pool_sizes]

    def generate(self, config: Any) -> PrefixTrace:
        return generate_hybrid(config)

    def ratio_lines(self, ratios: dict[str, Any]) -> str:
        lines = ["\nHit-rate parity: kvpool's prefix-hit tokens vs vLLM's hybrid coordinator's (target >=):"]
        for name, v in ratios["parity"].items():
            ok = "meets" if v["meets_target"] else "MISSES"
            ratio = f"{v['ratio']:.3f}" if v["ratio"] is not None else "n/a"
            lines.append(f"  {name:34s} kvpool {100 * v['kvpool_hit_share']:5.1f}%  vLLM "
                         f"{100 * v['baseline_hit_share']:5.1f}%  ratio {ratio}  {ok} target")
        if not ratios["parity"]:
            lines.append(NO_BASELINE)
        lines.append(f"vLLM µs/step ÷ kvpool µs/step (target >= {ratios['speedup_target']:g}x):")
        lines += or_none([ratio_line(name, v, "8.1f") for name, v in ratios["baseline_over_kvpool"].items()])
        return "\n".join(lines)


def _config(scenario: str, pool: int, concurrency: int, page_size: int, share: float,
            base: dict[str, Any]) -> HybridTraceConfig:
    """The case's config, its sliding group sized by ``split`` for the trace's longest prompt."""
    from kvpool.bench.prefix.trace import PrefixTraceConfig

    longest = PrefixTraceConfig(scenario, pool, concurrency, page_size,
                                **{k: v for k, v in base.items() if k != "window"}).max_prompt_len
    sliding = split(pool, concurrency, page_size, base["window"], max(base["step_prompt_tokens"], longest), share)
    return HybridTraceConfig(scenario, pool, concurrency, page_size, sliding_pages=sliding, **base)


HYBRID = HybridWorkload()
add_arguments = HYBRID.add_arguments
main = functools.partial(command.main, HYBRID)

__all__ = ["HYBRID", "HybridResult", "HybridWorkload", "add_arguments", "main"]
