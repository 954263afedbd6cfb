"""Request transfer between two pools over torch.distributed (gloo on CPU, or NCCL).

    python benchmarks/bench_transfer.py [--lengths 128,512,2048,8192] [--layers 16]
        [--kv-heads 8] [--head-dim 128] [--page-size 16] [--repeats 5] [--backend gloo]
        [--out bench_out/transfer.json]

Two processes on 127.0.0.1: rank 0 holds a request of each prompt length and
sends it with ``kvpool.distributed.send_request``; rank 1 receives it with
``recv_request`` and closes it. Per length it reports the median latency per
request (send call start to ack, as seen by the sender), the K/V bytes moved,
the GB/s that gives, and, as the ceiling, the same bytes sent as ONE contiguous tensor with a
bare ``dist.send``/``recv`` pair in the same run (``ratio`` = kvpool / bare).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if any((ROOT / "python" / "kvpool").glob("_core*.so")):
    sys.path.insert(0, str(ROOT / "python"))


def _worker(rank: int, port: int, args: argparse.Namespace, q: Any) -> None:
    import torch
    import torch.distributed as dist

    import kvpool
    from kvpool.distributed import recv_request, send_request

    torch.set_num_threads(1)
    dev = "cuda" if args.backend == "nccl" else "cpu"
    if dev == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    P, longest = args.page_size, max(args.lengths)
    pool = kvpool.KVPool(args.layers, args.kv_heads, args.head_dim, dtype=torch.bfloat16, device=dev,
                         page_size=P, num_pages=-(-longest // P) + 2, max_requests=4,
                         max_context_len=-(-longest // P) * P)
    rows = []
    for n in args.lengths:
        times, bare, stats = [], [], None
        for _ in range(args.repeats + 1):  # the first round warms up buffers and connections
            dist.barrier()
            if rank == 0:
                h = int(pool.open(1)[0])
                pool.extend([h], n)
                t0 = time.perf_counter()
                stats = send_request(pool, h, 1)
                times.append(time.perf_counter() - t0)
                pool.close([h])
            else:
                pool.close([recv_request(pool, 0)])
        nbytes = stats.bytes if stats else 0
        blob = torch.empty(max(1, nbytes if rank == 0 else 0), dtype=torch.uint8, device=dev)
        nb = torch.tensor([blob.numel()], device=dev)
        dist.broadcast(nb, 0)
        if rank == 1:
            blob = torch.empty(int(nb.item()), dtype=torch.uint8, device=dev)
        for _ in range(args.repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(blob, 1)
                ack = torch.zeros(1, device=dev)
                dist.recv(ack, 1)
            else:
                dist.recv(blob, 0)
                dist.send(torch.ones(1, device=dev), 0)
            bare.append(time.perf_counter() - t0)
        if rank == 0 and stats is not None:
            t, b = statistics.median(times[1:]), statistics.median(bare[1:])
            rows.append({"tokens": n, "pages": stats.pages, "bytes": nbytes, "messages": stats.messages,
                         "latency_ms": t * 1e3, "gbps": nbytes / t / 1e9,
                         "bare_latency_ms": b * 1e3, "bare_gbps": nbytes / b / 1e9, "ratio": b / t})
    pool.allocator.check()
    if rank == 0:
        q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,512,2048,8192", help="prompt lengths, comma-separated")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--timeout-s", type=float, default=600.0, help="kill both ranks after this long")
    ap.add_argument("--out", default="bench_out/transfer.json")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rows = q.get(timeout=args.timeout_s)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    per_token = 2 * args.layers * args.kv_heads * args.head_dim * 2
    print(f"kvpool request transfer, {args.backend}, 2 processes on 127.0.0.1: {args.layers} layers x "
          f"{args.kv_heads} KV heads x {args.head_dim}, bf16 ({per_token // 1024} KiB/token), page {args.page_size}")
    print(f"{'tokens':>7} {'MiB':>8} {'msgs':>5} {'ms/request':>11} {'GB/s':>7} {'bare GB/s':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['bytes'] / 2**20:>8.1f} {r['messages']:>5} {r['latency_ms']:>11.2f} "
              f"{r['gbps']:>7.2f} {r['bare_gbps']:>10.2f} {r['ratio']:>6.2f}")
    out = {"settings": {k: v for k, v in vars(args).items()}, "bytes_per_token": per_token, "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)
    print(f"figures written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
