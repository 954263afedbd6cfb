"""``python -m kvpool.bench ops``: single SlotAllocator operations at several batch sizes.

Each operation is a (prepare, run) pair for the same ``runner.time_loop`` the
churn replay uses: ``prepare`` puts the allocator in the state the operation
needs (untimed), ``run`` is the one call being measured.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool._core import MAX_PAGES, MAX_REQUESTS
from kvpool.bench import report
from kvpool.bench.cli import UsageError, add_out_argument, count, list_of, one_of, parse_size, settings
from kvpool.bench.runner import time_loop
from kvpool.progress import progress

OPS = ["open", "close", "extend-decode", "extend-prefill", "truncate"]
PREFILL = 512  # tokens per request for extend-prefill
BASE_LEN = 64  # length requests have before extend-decode / truncate / close
# The most tokens one request of each op holds (truncate extends by 32, then cuts them off).
TOKENS_HELD = {"open": 0, "close": BASE_LEN, "extend-decode": BASE_LEN + 1, "extend-prefill": PREFILL,
               "truncate": BASE_LEN + 32}
QUICK_DEFAULTS = dict(iters=20)  # --quick: few iterations (explicit --iters wins)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", type=list_of(one_of(OPS, "op")), default=list(OPS), help=f"subset of {','.join(OPS)}")
    p.add_argument("--batch-sizes", type=list_of(count(1)), default=[1, 16, 256, 1024])
    p.add_argument("--page-sizes", type=list_of(count(1)), default=[1, 16])
    p.add_argument("--pool-size", type=parse_size, default=1 << 20, help="slots (default 1M)")
    p.add_argument("--iters", type=count(1), default=1000, help="timed calls per (op, page, batch)")
    p.add_argument("--quick", action="store_true", help="few iterations: runs in seconds (an explicit --iters wins)")
    add_out_argument(p)
    p.add_argument("--json", default="ops.json", help="JSON output file, under --out ('' for none)")


class _OpBench:
    """Allocator, CPU req_to_token and the prepare/run pair for one (op, page, batch)."""

    def __init__(self, op: str, page_size: int, batch: int, num_slots: int) -> None:
        import kvpool

        self.max_ctx = 4096
        self.a = kvpool.SlotAllocator(num_slots // page_size, page_size, batch, self.max_ctx)
        self.table = np.zeros((batch, self.max_ctx), dtype=np.int32)
        self.table.fill(0)  # fault the pages in now, not inside a timed call
        self.batch, self.h = batch, np.zeros(0, dtype=np.int64)
        self.prepare: Callable[[int], Any]
        self.run: Callable[[Any], int]
        self.prepare, self.run = getattr(self, "_" + op.replace("-", "_"))()

    def _fresh(self, length: int) -> np.ndarray:
        if len(self.h):
            self.a.close(self.h)
        self.h = self.a.open(self.batch)
        if length:
            self.a.extend(self.h, length, table=self.table)
        return self.h

    def _open(self) -> tuple[Callable[[int], Any], Callable[[Any], int]]:
        def prepare(i: int) -> int:
            if len(self.h):
                self.a.close(self.h)
                self.h = self.h[:0]
            return self.batch

        def run(n: int) -> int:
            self.h = self.a.open(n)
            return n

        return prepare, run

    def _close(self) -> tuple[Callable[[int], Any], Callable[[Any], int]]:
        def prepare(i: int) -> np.ndarray:
            h = self._fresh(BASE_LEN)
            self.h = self.h[:0]  # run() closes it
            return h

        def run(h: np.ndarray) -> int:
            self.a.close(h)
            return len(h)

        return prepare, run

    def _extend_decode(self) -> tuple[Callable[[int], Any], Callable[[Any], int]]:
        def prepare(i: int) -> np.ndarray:
            full = not len(self.h) or self.a.length(int(self.h[0])) >= self.max_ctx
            if full or self.a.free_pages < self.batch:  # start over before the pool or a context fills
                self._fresh(BASE_LEN)
            return self.h

        def run(h: np.ndarray) -> int:
            return len(self.a.extend(h, 1, table=self.table))

        return prepare, run

    def _extend_prefill(self) -> tuple[Callable[[int], Any], Callable[[Any], int]]:
        def prepare(i: int) -> np.ndarray:
            return self._fresh(0)

        def run(h: np.ndarray) -> int:
            return len(self.a.extend(h, PREFILL, table=self.table))

        return prepare, run

    def _truncate(self) -> tuple[Callable[[int], Any], Callable[[Any], int]]:
        def prepare(i: int) -> np.ndarray:
            if not len(self.h):
                self._fresh(BASE_LEN)
            self.a.extend(self.h, 32, table=self.table)  # run() cuts these 32 tokens off again
            return self.h

        def run(h: np.ndarray) -> int:
            self.a.truncate(h, BASE_LEN)
            return len(h)

        return prepare, run


def check(args: argparse.Namespace) -> None:
    """Flags that parse but cannot run together: every pool of whole pages, within the allocator's
    bounds, with room for every batch."""
    if max(args.batch_sizes) > MAX_REQUESTS:  # each batch is its pool's max_requests
        raise UsageError(f"--batch-sizes {max(args.batch_sizes)} is more requests than kvpool's allocator takes; "
                         f"give batch sizes in [1, {MAX_REQUESTS}]")
    for ps in args.page_sizes:
        pages = args.pool_size // ps
        if args.pool_size % ps:
            raise UsageError(f"--pool-size {args.pool_size} is not a whole number of pages of {ps} slots; "
                             "give a multiple of every --page-sizes value")
        if pages > MAX_PAGES:
            raise UsageError(f"--pool-size {args.pool_size} is {pages} pages of {ps}; kvpool's allocator takes at "
                             f"most {MAX_PAGES} pages (page 0 included): give a smaller --pool-size")
        need = max(args.batch_sizes) * -(-max(TOKENS_HELD[op] for op in args.ops) // ps) + 1  # page 0 reserved
        if need > pages:
            raise UsageError(f"--pool-size {args.pool_size} holds {pages} pages of {ps}; batch "
                             f"{max(args.batch_sizes)} needs {need}: give a larger --pool-size or smaller "
                             "--batch-sizes")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    check(args)
    plan = [(op, ps, b) for op in args.ops for ps in args.page_sizes for b in args.batch_sizes]
    rows = []
    for op, ps, b in progress(plan, desc="ops", unit="run", file=sys.stderr):
        bench = _OpBench(op, ps, b, args.pool_size)
        time_loop(bench.prepare, bench.run, min(20, args.iters))  # warm caches and code paths
        s = time_loop(bench.prepare, bench.run, args.iters).summary()
        bench.a.check()
        unit = "slot" if op.startswith("extend") else "request"
        rows.append({"op": op, "page_size": ps, "batch": b, "iters": args.iters, "item": unit,
                     "mean_us": s["mean_us"], "p50_us": s["p50_us"], "p99_us": s["p99_us"],
                     "ns_per_item": s["ns_per_item"]})
    return rows


def ops_table(rows: list[dict[str, Any]]) -> str:
    header = ["op", "page", "batch", "µs mean", "p50", "p99", "ns/item"]
    body = [[r["op"], str(r["page_size"]), str(r["batch"]), f"{r['mean_us']:.2f}", f"{r['p50_us']:.2f}",
             f"{r['p99_us']:.2f}", f"{r['ns_per_item']:.1f}"] for r in rows]
    return report.md_table(header, body)


def main(args: argparse.Namespace, machine: dict[str, Any]) -> int:
    rows = run(args)
    print(ops_table(rows))
    if args.json:
        path = report.output_path(args.out, args.json)
        report.write_json(path, {"benchmark": "ops", "settings": settings(args), "machine": machine,
                                 "results": rows})
        print(f"wrote {path}")
    return 0
