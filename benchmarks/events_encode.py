"""The msgpack encoder of KV events alone (``kvpool._core.encode_kv_events``), without the
drain or the publisher around it, to compare two builds of the wire encoding.

The events are one step's of ``python -m kvpool.bench events`` at its largest (3/4 Stored in
8-page chains, 1/4 Removed), drained once and encoded ``--calls`` times a round; prints the
fastest round's µs a call.

    PYTHONPATH=python python benchmarks/events_encode.py --page-size 1 [--int-block-hashes]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import kvpool
from kvpool._core import encode_kv_events

CHAIN = 8  # pages per request, as the events bench


def events(page_size: int, stored: int = 7520, removed: int = 2500) -> dict:
    """Drained events: ``stored`` pages cached by requests of CHAIN pages, then ``removed`` evicted."""
    a = kvpool.SlotAllocator(stored * 2 + 64, page_size, stored // CHAIN, CHAIN * page_size + 1)
    rng = np.random.default_rng(0)
    lens = [CHAIN * page_size] * (stored // CHAIN)
    tokens = rng.integers(0, 32000, size=sum(lens))
    tokens[np.cumsum([0] + lens[:-1])] = 32000 + np.arange(len(lens))  # no two requests share a page
    h, _ = a.open_with_prefix(tokens, lens)
    a.extend(h, np.asarray(lens))
    a.close(h, cache=True)
    a.evict(removed)
    return a.take_events()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--int-block-hashes", action="store_true", help="vLLM's int form of the hashes")
    p.add_argument("--calls", type=int, default=200, help="encodes a round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    e = events(args.page_size)
    rounds = []
    for _ in range(args.rounds):
        t = time.perf_counter_ns()
        for _ in range(args.calls):
            encode_kv_events(e, 1.0, int_block_hashes=args.int_block_hashes)
        rounds.append((time.perf_counter_ns() - t) / args.calls / 1e3)
    form = "int" if args.int_block_hashes else "bytes"
    print(f"{len(e['kind'])} events, page {args.page_size}, {form} hashes: {min(rounds):.1f} µs an encode "
          f"(fastest of {args.rounds} rounds of {args.calls})")


if __name__ == "__main__":
    main()
