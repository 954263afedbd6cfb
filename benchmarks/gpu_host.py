"""Host microseconds per pool call on a GPU pool (benchmarks/gpu_session.py): what the
scheduler thread pays for `extend(B=256)` (one decode token each), `admit` (16 new
requests of 128 tokens), an eager `write` of B rows (device and host slots), and
`DecodeGraphRunner.run` of a 2-layer toy step at batch B (host and device inputs), with the GPU never synchronised
inside the timed loop (a call that waited for the GPU would show here; the runner's
figures are synchronised after each call, untimed, since its replay outlasts its host
part); and
`write_overhead`: eager `write` / `read` over the bare copies into the same buffers,
per layout at 1 and 64 rows (kvpool.bench.rows_cost, target write <= 15 µs).

Each figure: median and p90 of single calls, perf_counter_ns around each. --device cpu
is a dry run of the logic (a CPU pool, batch 8; figures meaningless for a GPU).
Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_common import RUN, log, sync


def _time(fn: Callable[[int], Any], iters: int, warm: int = 5,
          after: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Host time of fn(i) per call; after(result), if given, runs untimed after each."""
    for i in range(warm):
        r = fn(i)
        if after is not None:
            after(r)
    sync()
    ns = []
    for i in range(iters):
        t0 = time.perf_counter_ns()
        r = fn(warm + i)
        ns.append(time.perf_counter_ns() - t0)
        if after is not None:
            after(r)
    sync()
    ns.sort()
    return {"median_us": round(statistics.median(ns) / 1e3, 2), "p90_us": round(ns[int(0.9 * (len(ns) - 1))] / 1e3, 2),
            "min_us": round(ns[0] / 1e3, 2), "iters": iters}


def measure(iters: int, B: int) -> dict[str, Any]:
    import kvpool
    from kvpool.cuda_graph import DecodeGraphRunner
    from kvpool.testing.toy_step import ToyDecode

    dev = RUN.dev
    steps = (2 if RUN.profile else 1) * iters + 10
    pool = kvpool.KVPool(2, 8, 128, dtype=torch.bfloat16, device=dev, page_size=16,
                         num_pages=B * (steps + 64) // 16 + 512, max_requests=B + 32, max_context_len=steps + 160)
    out: dict[str, Any] = {"batch": B, "device": dev}
    handles = pool.open(B)
    pool.extend(handles, np.full(B, 16, dtype=np.int64))
    out[f"extend_B{B}"] = _time(lambda i: pool.extend(handles, 1), iters)
    if RUN.profile:  # which functions the extend's host time goes to (call_profile)
        from call_profile import profile_calls

        out[f"extend_B{B}_profile"] = profile_calls(
            type(pool), "extend", lambda: [pool.extend(handles, 1) for _ in range(iters)], RUN.profile)
    last = pool.extend(handles, 1)

    counts = np.full(16, 128, dtype=np.int64)
    out["admit_16x128"] = _time(lambda i: pool.admit(counts)[0], iters, after=pool.close)  # close untimed

    k = torch.randn((B, 8, 128), device=dev).to(torch.bfloat16)
    dev_slots, host_slots = last.out_cache_loc[:B], np.asarray(last.slots[:B])
    out["write_device_slots"] = _time(lambda i: pool.write(i % 2, dev_slots, k, k), iters)
    out["write_host_slots"] = _time(lambda i: pool.write(i % 2, host_slots, k, k), iters)

    runner = DecodeGraphRunner(pool, ToyDecode(pool), B, buckets=[B])
    lens = np.asarray(pool.lengths(handles))
    host = (np.zeros(B, dtype=np.int64), lens - 1, np.asarray(pool.rows(handles)), host_slots, lens)
    device = tuple(torch.as_tensor(np.asarray(a, dtype=np.int64), device=dev) for a in host)
    with torch.inference_mode():
        runner.capture()
        # A replay of this step at B=256 is ~3 ms of GPU work, far more than run()'s host
        # part: back to back, run() would soon wait for the launch queue or the pinned
        # ring and time the GPU. Synchronised after each call (untimed), it times the host.
        # (gpu_check's no_sync section shows run() does not wait on queued work.)
        out["runner_run_host_inputs"] = _time(lambda i: runner.run(*host), iters, after=lambda r: sync())
        out["runner_run_device_inputs"] = _time(lambda i: runner.run(*device), iters, after=lambda r: sync())
    for name, r in out.items():
        if isinstance(r, dict) and "median_us" in r:
            log(f"[host_us] {name:>26}: median {r['median_us']:8.2f} us, p90 {r['p90_us']:8.2f} us")
    out["write_overhead"] = write_overhead(dev, dry=RUN.dry)
    return out


def write_overhead(dev: str, dry: bool) -> list:
    """pool.write / read host µs per call over two bare index_copy_ / index_select into the
    same buffers, eager, per layout at 1 and 64 rows (bf16, 8 KV heads x 128): the
    figure `python -m kvpool.bench overhead` gives on CPU (target on a GPU: write
    <= 15 µs of host time per call)."""
    from kvpool.bench.rows_cost import row_overhead

    rows = row_overhead(dev, rounds=3 if dry else 15, calls=10 if dry else 200)
    for r in rows:
        log(f"[host_us] write {r['layout']:>5} x{r['rows']:<3}: {r['write_us']:7.2f} us "
            f"(bare copies {r['bare_write_us']:6.2f}, + {r['write_overhead_us']:5.2f}); "
            f"read {r['read_us']:7.2f} us (+ {r['read_overhead_us']:5.2f})")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="decode batch (default 256; 8 on cpu)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile the extends (cProfile) and report their N costliest functions")
    args = ap.parse_args()
    RUN.dev, RUN.dry, RUN.profile = args.device, args.device == "cpu", args.profile
    iters = args.iters or (5 if RUN.dry else 200)
    report = measure(iters, args.batch or (8 if RUN.dry else 256))
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
