"""``python -m kvpool.bench route``: a cache-aware router over 4 pools against round-robin.

The prefix benchmark's multi-turn workload (``chat``: each turn resends the
whole conversation) is replayed over ``--pools`` kvpool pools in one process,
twice: once routed by ``kvpool.router.Router`` (fed only by the pools' KV
events, one step late) and once round-robin. Reported: hit rate and prefill
tokens of each, the router's host µs per request (hashing the prompt and
walking its index) and per event applied, and agreement: how often the
router's predicted hit equals the ``cached_lens`` the chosen pool returned
(target >= 99.9%), with every disagreement and its cause.

``python -m kvpool.bench events`` times ``ZmqEventPublisher.publish()`` (see
``kvpool.bench.route.events_main``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvpool.bench import cli, report
from kvpool.bench.prefix.trace import SCENARIOS, PrefixTraceConfig, generate
from kvpool.bench.trace import Dist
from kvpool.router.router import MAX_POOLS

AGREEMENT_TARGET = 0.999
# --quick: seconds (tests, CI): short prompts and outputs, so turns come back within the steps.
QUICK_DEFAULTS = dict(steps=60, warmup=20, lanes=8, pool_slots=1 << 13)
QUICK_LENGTHS = dict(user_len=Dist(16, 64), output=Dist(4, 24), turns=Dist(2, 6), think_steps=Dist(1, 4),
                     system_len=Dist(128, 512), parallel_prompt=Dist(64, 256))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pools", type=cli.count(1, MAX_POOLS), default=4, help=f"pools (default 4, at most {MAX_POOLS})")
    p.add_argument("--scenario", default="chat", choices=SCENARIOS, help="prefix trace scenario (default chat)")
    p.add_argument("--page-size", type=cli.count(1), default=16)
    p.add_argument("--pool-slots", type=cli.parse_size, default=1 << 16, help="slots per pool (default 64K)")
    p.add_argument("--lanes", type=cli.count(1), default=32, help="running sequences per pool (default 32)")
    p.add_argument("--fill", type=cli.fraction(), default=0.85,
                   help="the trace admits while the fleet's reservations fit in this share of its pages "
                        "(default 0.85: slack so that each group finds a pool with room)")
    p.add_argument("--steps", type=cli.count(1), default=2400, help="measured steps (default 2400)")
    p.add_argument("--warmup", type=cli.count(0), default=200, help="steps before the measured ones (default 200)")
    p.add_argument("--seed", type=cli.count(0), default=0)
    p.add_argument("--quick", action="store_true", help="tiny pools and few steps (seconds); flags given "
                                                        "explicitly keep their values")
    p.add_argument("--json", default="route.json", help="JSON output file, under --out ('' for none)")
    report.add_out_argument(p)


def config(args: argparse.Namespace) -> tuple[PrefixTraceConfig, int]:
    """The fleet-wide trace config and the pages of each pool (``cli.UsageError`` if the flags make none)."""
    lengths: dict[str, Any] = QUICK_LENGTHS if args.quick else {}
    ps = args.page_size
    if args.pool_slots % ps:
        raise cli.UsageError(f"--pool-slots {args.pool_slots} is not a whole number of pages of {ps} slots; give a "
                             "multiple of --page-size")
    pool_pages = args.pool_slots // ps
    fleet_pages = int(args.pools * pool_pages * args.fill)
    if fleet_pages < 2:
        # Said here: the trace config's complaint names python -m kvpool.bench prefix's --pool-sizes.
        raise cli.UsageError(f"--pools {args.pools} x --pool-slots {args.pool_slots} x --fill {args.fill} fill "
                             f"{fleet_pages} page(s) of {ps} slots; the traces need at least 2 (one besides the "
                             "reserved page 0): give a larger --pool-slots, --pools or --fill")
    try:
        cfg = PrefixTraceConfig(args.scenario, num_slots=fleet_pages * ps, concurrency=args.pools * args.lanes,
                                page_size=ps, steps=args.steps, warmup=args.warmup, seed=args.seed, **lengths)
    except ValueError as e:
        raise cli.UsageError(f"{e} (from --pools, --pool-slots, --page-size, --lanes and --fill)") from None
    return cfg, pool_pages


def table(results: list[Any]) -> str:
    rows = []
    for r in results:
        us = r.to_json()["route_us"]
        rows.append([r.policy, f"{r.hit_rate:.1%}", f"{r.hit_tokens}", f"{r.prefill_tokens}", f"{r.prompt_tokens}",
                     f"{r.evicted_pages}", "/".join(map(str, r.requests_per_pool)),
                     f"{us['mean']:.1f} / {us['p50']:.1f} / {us['p99']:.1f}" if us else "",
                     f"{r.feed_us_per_event:.2f}" if r.policy == "router" else "",
                     f"{r.agreement:.4%} ({r.agreed}/{r.agreed + len(r.disagreements)})" if r.agreement is not None
                     else ""])
    return report.md_table(["policy", "hit rate", "hit tokens", "prefill tokens", "prompt tokens", "evicted pages",
                       "requests per pool", "router µs/req mean / p50 / p99", "feed µs/event", "agreement"], rows)


def main(args: argparse.Namespace, machine: dict[str, Any]) -> int:
    from kvpool.bench.route_driver import replay

    cfg, pool_pages = config(args)
    try:
        trace = generate(cfg)
    except ValueError as e:  # a request that never fits the pools the flags describe
        raise cli.UsageError(f"{e}: give larger --pool-slots or a larger --fill") from None
    results = [replay(trace, args.pools, pool_pages, policy) for policy in ("router", "round-robin")]
    routed, rr = results
    print(f"{args.scenario} trace, {args.pools} pools of {pool_pages} pages (page {cfg.page_size}), "
          f"{args.lanes} lanes each, {args.warmup} + {args.steps} steps; hit rate and tokens over the measured "
          "steps, agreement over every request")
    print(table(results))
    # None (the JSON's null) where the divisor is 0: round-robin hit nothing, or the router prefilled
    # nothing. They printed 'xinf' (and the JSON null) with no word of why.
    factor = routed.hit_rate / rr.hit_rate if rr.hit_rate else None
    prefill = rr.prefill_tokens / routed.prefill_tokens if routed.prefill_tokens else None
    hits = (f"x{factor:.2f}" if factor is not None else
            f"n/a (round-robin hit nothing; the router {routed.hit_rate:.1%})")
    saved = f"/ {prefill:.2f}" if prefill is not None else "n/a (the router prefilled nothing)"
    print(f"router / round-robin: hit rate {hits}, prefill tokens {saved}")
    for d in routed.disagreements:
        print("disagreement:", d.line())
    bugs = [d for d in routed.disagreements if d.cause.startswith("bug")]
    ok = routed.agreement is None or routed.agreement >= AGREEMENT_TARGET
    agreed = f"{routed.agreement:.4%}" if routed.agreement is not None else "n/a (no request routed)"
    print(f"agreement {agreed} (target >= {AGREEMENT_TARGET:.1%}): {'met' if ok else 'MISSED'}; "
          f"{len(bugs)} unexplained")
    if args.quick:
        print("(quick run: tiny pools and few steps, a smoke test; the figures are for the full run)")
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    doc = {"benchmark": "route", "settings": settings, "machine": machine, "pool_pages": pool_pages,
           "hit_rate_factor": factor, "prefill_ratio": prefill, "agreement_target": AGREEMENT_TARGET,
           "results": [r.to_json() for r in results]}
    if args.json:
        path = report.output_path(args.out, args.json)
        report.write_json(path, doc)
        print(f"wrote {path}")
    return 0 if ok and not bugs else 1


def add_events_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=_sizes, default="10,100,1000,10000",
                   help="events per publish() (default 10,100,1000,10000)")
    p.add_argument("--page-size", type=cli.count(1), default=16)
    p.add_argument("--repeats", type=cli.count(1), default=200, help="publish() calls timed per size (median reported)")
    p.add_argument("--json", default="events.json", help="JSON output file, under --out ('' for none)")
    report.add_out_argument(p)


def _sizes(text: str) -> str:
    """--sizes checked as the command line is parsed, kept as text (as the JSON records it)."""
    cli.list_of(cli.count(1))(text)
    return text


def events_main(args: argparse.Namespace, machine: dict[str, Any]) -> int:
    from kvpool.bench.events_cost import measure, shape_problem

    sizes = cli.list_of(cli.count(1))(args.sizes)
    problem = shape_problem(sizes, args.page_size)
    if problem:
        raise cli.UsageError(problem)
    rows = measure(sizes, args.page_size, args.repeats)
    print("ZmqEventPublisher.publish() of one step's events: what the calling thread pays (drain, encode, "
          "hand over) and until the sender thread has sent it (PUB on loopback, one subscriber); medians")
    print(report.md_table(["events", "Stored : Removed", "µs / publish()", "µs per 100 events", "µs until sent",
                      "payload bytes"],
                     [[str(r["events"]), r["mix"], f"{r['us']:.2f}", f"{r['us_per_100']:.2f}",
                       f"{r['us_until_sent']:.2f}", str(r["payload_bytes"])] for r in rows]))
    if args.json:
        path = report.output_path(args.out, args.json)
        report.write_json(path, {"benchmark": "events", "settings": {k: v for k, v in vars(args).items()
                                                                      if k != "func"},
                                 "machine": machine, "results": rows})
        print(f"wrote {path}")
    return 0


__all__ = ["add_arguments", "add_events_arguments", "events_main", "main"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: python -m kvpool.bench route")
