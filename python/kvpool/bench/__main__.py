"""``python -m kvpool.bench {churn,ops,overhead,prefix,hybrid,hybrid-memory,route,events} [--out DIR] [...]``: outputs go under DIR (default: the current directory)."""

from __future__ import annotations

import argparse
import sys

COMMANDS = ("churn", "ops", "overhead", "prefix", "hybrid", "hybrid-memory", "route", "events")


def main(argv: list[str] | None = None) -> int:
    try:
        import torch  # noqa: F401  (every benchmark needs it; kvpool itself imports without it)
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        print("python -m kvpool.bench: needs torch, which is not installed: pip install 'torch>=2.4'", file=sys.stderr)
        return 1
    parser = argparse.ArgumentParser(prog="python -m kvpool.bench", description=__doc__)
    from kvpool.bench import cli

    parser.add_argument("--torch-threads", type=cli.count(1), default=1,
                        help="torch intra-op threads for the baselines' CPU tensor ops (default 1: on a "
                             "small shared host, more threads make them slower and noisier)")
    sub = parser.add_subparsers(dest="command", required=True)
    from kvpool.bench import churn, hybrid, hybrid_memory, ops, overhead, prefix, route

    # (name, help, add_arguments, run, --quick's defaults: flags given on the command line keep their values)
    commands = [
        ("churn", "continuous-batching slot churn, kvpool vs SGLang and vLLM", churn.add_arguments, churn.main,
         churn.CHURN.quick_defaults),
        ("ops", "single SlotAllocator operations at several batch sizes", ops.add_arguments, ops.main,
         ops.QUICK_DEFAULTS),
        ("overhead", "host time the torch layer adds: write/read over bare copies, KVPoolCache vs DynamicCache, "
         "a fresh pool's first burst", overhead.add_arguments, overhead.main, overhead.QUICK_DEFAULTS),
        ("prefix", "prefix caching: hit rate and host µs/step, kvpool vs SGLang and vLLM", prefix.add_arguments,
         prefix.main, prefix.PREFIX.quick_defaults),
        ("hybrid", "prefix caching on full + sliding-window layer groups: hit rate and host µs/step, kvpool vs "
         "vLLM's hybrid coordinator", hybrid.add_arguments, hybrid.main, hybrid.HYBRID.quick_defaults),
        ("hybrid-memory", "layer groups (full + sliding window): device bytes per request and concurrent requests "
         "at 32K, vs every layer in full", hybrid_memory.add_arguments, hybrid_memory.main, {}),
        ("route", "cache-aware routing over 4 pools by their KV events, vs round-robin", route.add_arguments,
         route.main, route.QUICK_DEFAULTS),
        ("events", "cost of publishing a step's KV events (ZmqEventPublisher.publish)", route.add_events_arguments,
         route.events_main, {}),
    ]
    assert tuple(c[0] for c in commands) == COMMANDS
    parsers = {}
    for name, help_text, add_arguments, run, quick in commands:
        p = sub.add_parser(name, help=help_text)
        add_arguments(p)
        p.set_defaults(func=run)
        parsers[name] = (p, quick)
    args = parser.parse_args(argv)
    p, quick = parsers[args.command]
    if getattr(args, "quick", False) and quick:
        # --quick shrinks what the command line leaves at its defaults, never a flag given explicitly.
        full = {k: p.get_default(k) for k in quick}
        p.set_defaults(**quick)
        try:
            args = parser.parse_args(argv)
        finally:
            p.set_defaults(**full)
    problem = cli.check_outputs(args)
    if problem:
        p.error(problem)

    import torch

    from kvpool.bench.report import machine_info

    threads = torch.get_num_threads()
    torch.set_num_threads(args.torch_threads)
    try:
        return int(args.func(args, machine_info()))
    except cli.UsageError as e:  # flags that cannot run together, found before anything ran
        p.error(str(e))
    finally:
        torch.set_num_threads(threads)  # callers in the same process (tests) keep their setting


if __name__ == "__main__":
    sys.exit(main())
