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

    p = sub.add_parser("churn", help="continuous-batching slot churn, kvpool vs SGLang and vLLM")
    churn.add_arguments(p)
    p.set_defaults(func=churn.main)
    p = sub.add_parser("ops", help="single SlotAllocator operations at several batch sizes")
    ops.add_arguments(p)
    p.set_defaults(func=ops.main)
    p = sub.add_parser("overhead", help="host time the torch layer adds: write/read over bare copies, "
                       "KVPoolCache vs DynamicCache, a fresh pool's first burst")
    overhead.add_arguments(p)
    p.set_defaults(func=overhead.main)
    p = sub.add_parser("prefix", help="prefix caching: hit rate and host µs/step, kvpool vs SGLang and vLLM")
    prefix.add_arguments(p)
    p.set_defaults(func=prefix.main)
    p = sub.add_parser("hybrid", help="prefix caching on full + sliding-window layer groups: hit rate and host "
                       "µs/step, kvpool vs vLLM's hybrid coordinator")
    hybrid.add_arguments(p)
    p.set_defaults(func=hybrid.main)
    p = sub.add_parser("hybrid-memory", help="layer groups (full + sliding window): device bytes per request "
                       "and concurrent requests at 32K, vs every layer in full")
    hybrid_memory.add_arguments(p)
    p.set_defaults(func=hybrid_memory.main)
    p = sub.add_parser("route", help="cache-aware routing over 4 pools by their KV events, vs round-robin")
    route.add_arguments(p)
    p.set_defaults(func=route.main)
    p = sub.add_parser("events", help="cost of publishing a step's KV events (ZmqEventPublisher.publish)")
    route.add_events_arguments(p)
    p.set_defaults(func=route.events_main)
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
