"""Where a prefix-caching step's host time goes: kvpool's prefix driver (the calls of
``python -m kvpool.bench prefix``) with each call timed on its own, per page size.

    python benchmarks/prefix_split.py --scenario system --page-sizes 1,16

Prints µs per step for each call (close, open_with_prefix, the prompt's extend, cache, fork,
the decode extend, take_copies) and the prompt and hit tokens per step. ``--split-close``
times a finished request's registration (``cache``) apart from its release
(``close(cache=False)``), the two halves of ``close(cache=True)``. ``--cache-at-decode`` also
registers each decode step's new pages with one ``cache()`` of the decode batch (vLLM's
``allocate_slots`` caches a block as it fills), so a closing request has nothing left to
register: the other order of the same registrations. Figures only; the
comparison with other caches is ``python -m kvpool.bench prefix``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import time

from kvpool.bench.cli import count, list_of, parse_size
from kvpool.bench.drivers.kvpool_prefix import KVPoolPrefixDriver
from kvpool.bench.prefix.trace import SCENARIOS, PrefixTraceConfig, generate


def split(scenario: str, page_size: int, num_slots: int, steps: int, warmup: int,
          kv_events: bool = True, split_close: bool = False, cache_at_decode: bool = False) -> dict[str, float]:
    cfg = PrefixTraceConfig(scenario=scenario, num_slots=num_slots, page_size=page_size,
                            steps=steps, warmup=warmup, kv_events=kv_events)
    trace = generate(cfg)
    d = KVPoolPrefixDriver(cfg, 8192)
    for s in trace.steps[: cfg.warmup]:
        d.run(d.prepare(s))
        if cache_at_decode and len(s.decode_lanes):
            d.alloc.cache(d.handles[s.decode_lanes])
    ns: dict[str, int] = collections.defaultdict(int)
    tokens = collections.Counter(prompt=0, hit=0)  # a short run may admit nothing
    clock = time.perf_counter_ns
    gc.collect()

    def timed(name, fn, *args, **kw):
        t = clock()
        out = fn(*args, **kw)
        ns[name] += clock() - t
        return out

    for s in trace.measured:
        finished, groups, decoding, fed = d.prepare(s)
        a, table = d.alloc, d.table
        if len(finished) and split_close:
            timed("close: cache", a.cache, finished)
            timed("close: release", a.close, finished, cache=False)
        elif len(finished):
            timed("close", a.close, finished, cache=True)
        for prompt, length, lanes, k in groups:
            h, cached = timed("open_with_prefix", a.open_with_prefix, prompt, length, table=table)
            tokens["prompt"] += int(length[0])
            tokens["hit"] += int(cached[0])
            timed("extend prompt", a.extend, h, int(length[0]) - int(cached[0]), table=table)
            timed("cache", a.cache, h)
            d.handles[lanes[0]] = int(h[0])
            if k > 1:
                d.handles[lanes[1:]] = timed("fork", a.fork, int(h[0]), k - 1, table=table)
        if len(decoding):
            timed("decode extend", a.extend, decoding, 1, tokens=fed, table=table)
            timed("take_copies", a.take_copies)
            if cache_at_decode:
                timed("decode cache", a.cache, decoding)
    n = len(trace.measured)
    out = {k: v / n / 1e3 for k, v in ns.items()}
    out["total"] = sum(ns.values()) / n / 1e3
    out.update({f"{k} tokens": v / n for k, v in tokens.items()})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default="system", choices=SCENARIOS)
    p.add_argument("--page-sizes", type=list_of(count(1)), default=[1, 16], help="default 1,16")
    p.add_argument("--num-slots", type=parse_size, default=1 << 20, help="pool size in slots (default 1M)")
    p.add_argument("--steps", type=count(1), default=300)
    p.add_argument("--warmup", type=count(0), default=200)
    p.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                   help="pools without KV events (their index keys by the internal chain)")
    p.add_argument("--split-close", action="store_true",
                   help="time a closing request's registration and its release apart")
    p.add_argument("--cache-at-decode", action="store_true",
                   help="register each decode step's new pages then (one cache() of the batch), not at close")
    args = p.parse_args(argv)
    try:  # every page size's config before the first run: a bad one is a usage error, not a late traceback
        for ps in args.page_sizes:
            PrefixTraceConfig(scenario=args.scenario, num_slots=args.num_slots, page_size=ps, steps=args.steps,
                              warmup=args.warmup)
    except ValueError as e:
        p.error(str(e).replace("--pool-sizes", "--num-slots"))  # the trace names python -m kvpool.bench's flag
    for ps in args.page_sizes:
        r = split(args.scenario, ps, args.num_slots, args.steps, args.warmup, args.kv_events, args.split_close,
                  args.cache_at_decode)
        calls = ", ".join(f"{k} {v:.1f}" for k, v in r.items() if not k.endswith("tokens") and k != "total")
        print(f"{args.scenario} page {ps}: {r['total']:.1f} µs/step ({calls}); "
              f"{r['prompt tokens']:.0f} prompt and {r['hit tokens']:.0f} hit tokens per step")

if __name__ == "__main__":
    main()
