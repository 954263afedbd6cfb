"""``python -m kvpool.bench {churn,ops,overhead,prefix,hybrid,hybrid-memory,route,events} [--out DIR] [...]``: outputs go under DIR (default: the current directory)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpool.bench", description=__doc__)
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads for the baselines' CPU tensor ops (default 1: on a "
                             "small shared host, more threads make them slower and noisier)")
    sub = parser.add_subparsers(dest="command", required=True)
    from kvpool.bench import churn, hybrid, hybrid_memory, ops, overhead, prefix, route

    commands = [
        ("churn", "continuous-batching slot churn, kvpool vs SGLang and vLLM", churn.add_arguments, churn.main),
        ("ops", "single SlotAllocator operations at several batch sizes", ops.add_arguments, ops.main),
        ("overhead", "host time the torch layer adds: write/read over bare copies, KVPoolCache vs DynamicCache, "
         "a fresh pool's first burst", overhead.add_arguments, overhead.main),
        ("prefix", "prefix caching: hit rate and host µs/step, kvpool vs SGLang and vLLM", prefix.add_arguments,
         prefix.main),
        ("hybrid", "prefix caching on full + sliding-window layer groups: hit rate and host µs/step, kvpool vs "
         "vLLM's hybrid coordinator", hybrid.add_arguments, hybrid.main),
        ("hybrid-memory", "layer groups (full + sliding window): device bytes per request and concurrent requests "
         "at 32K, vs every layer in full", hybrid_memory.add_arguments, hybrid_memory.main),
        ("route", "cache-aware routing over 4 pools by their KV events, vs round-robin", route.add_arguments,
         route.main),
        ("events", "cost of publishing a step's KV events (ZmqEventPublisher.publish)", route.add_events_arguments,
         route.events_main),
    ]
    for name, help_text, add_arguments, run in commands:
        p = sub.add_parser(name, help=help_text)
        add_arguments(p)
        p.set_defaults(func=run)
    args = parser.parse_args(argv)

    import torch

    from kvpool.bench.report import machine_info

    threads = torch.get_num_threads()
    torch.set_num_threads(args.torch_threads)
    try:
        return int(args.func(args, machine_info()))
    finally:
        torch.set_num_threads(threads)  # callers in the same process (tests) keep their setting


if __name__ == "__main__":
    sys.exit(main())
