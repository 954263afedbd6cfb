"""Host time of ``KVPool.write`` / ``read`` over the bare copies they make.

A pool of 2 layers, bf16, 8 KV heads x 128 (token layout at page size 1, paged
at 16). For 1 and 64 rows, each round times ``calls`` calls of every variant
back to back, in an order that alternates between rounds, and each variant's
figure is the median over rounds of (its µs per call - the bare copies' µs per
call in the same round):

- ``write``: ``pool.write(layer, res.out_cache_loc, k, v)``, slots the pool made;
- ``write_caller``: the same slots in a tensor the caller made (checked in full);
- ``read``: ``pool.read(layer, res.out_cache_loc)``;
- bare: ``index_copy_`` into the layer's K and V views (``index_select`` for read);
- ``bare_scatter`` (CPU): the core's row copy that a CPU ``write`` stores with
  (``_core.scatter_rows``), called directly: ``write`` over it is the torch
  layer's own cost, since ``write`` no longer stores through ``index_copy_``.

On CUDA (``benchmarks/gpu_host.py``) the same loop measures host µs per call:
nothing synchronises inside a timed batch of calls, so a launch that waited for
the GPU would show.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LAYOUTS", "ROWS", "row_overhead"]

LAYOUTS = (("token", 1), ("paged", 16))
ROWS = (1, 64)
HEADS, HEAD_DIM = 8, 128


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _variants(layout: str, page: int, rows: int, device: torch.device) -> dict[str, Callable[[], Any]]:
    import kvpool

    pool = kvpool.KVPool(2, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device, page_size=page,
                         num_pages=rows + 2, max_requests=rows, max_context_len=16,
                         layout=layout, kv_events=False)
    handles = pool.open(rows)
    res = pool.extend(handles, 1)
    loc = res.out_cache_loc
    caller = loc.clone()
    g = torch.Generator(device="cpu").manual_seed(0)
    k = torch.randn(rows, HEADS, HEAD_DIM, generator=g).to(device, torch.bfloat16)
    v = torch.randn(rows, HEADS, HEAD_DIM, generator=g).to(device, torch.bfloat16)
    kf = pool.k_buffer(0).reshape(-1, HEADS, HEAD_DIM)
    vf = pool.v_buffer(0).reshape(-1, HEADS, HEAD_DIM)

    def bare_write() -> None:
        kf.index_copy_(0, loc, k)
        vf.index_copy_(0, loc, v)

    fns = {
        "bare_write": bare_write,
        "write": lambda: pool.write(0, loc, k, v),
        "write_caller": lambda: pool.write(0, caller, k, v),
        "bare_read": lambda: (kf.index_select(0, loc), vf.index_select(0, loc)),
        "read": lambda: pool.read(0, loc),
    }
    if device.type == "cpu":
        from kvpool._core import scatter_rows

        pair = (kf, vf)
        fns["bare_scatter"] = lambda: scatter_rows(pair, loc, (k, v))
    return fns


def _time(fn: Callable[[], Any], calls: int, device: torch.device) -> tuple[float, float]:
    """(wall µs, this thread's CPU µs) per call of ``calls`` calls."""
    _sync(device)
    c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
    for _ in range(calls):
        fn()
    t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
    _sync(device)
    return (t1 - t0) / calls / 1e3, (c1 - c0) / calls / 1e3


def row_overhead(device: Any = "cpu", rounds: int = 15, calls: int = 200) -> list[dict[str, Any]]:
    """One result per (layout, rows): µs per call of every variant and each one's
    overhead over its bare copies, medians over rounds."""
    dev = torch.device(device)
    out = []
    for layout, page in LAYOUTS:
        for rows in ROWS:
            fns = _variants(layout, page, rows, dev)
            names = list(fns)
            for fn in fns.values():  # warm every path (and, on CUDA, compile the kernels)
                for _ in range(20):
                    fn()
            per: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
            for r in range(rounds):
                for n in names if r % 2 == 0 else names[::-1]:
                    per[n].append(_time(fns[n], calls, dev))
            row: dict[str, Any] = {"layout": layout, "page_size": page, "rows": rows, "device": str(dev),
                                   "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16",
                                   "rounds": rounds, "calls": calls}
            for n in names:
                row[f"{n}_us"] = statistics.median(x[0] for x in per[n])
                row[f"{n}_cpu_us"] = statistics.median(x[1] for x in per[n])
            pairs = [("write", "bare_write"), ("write_caller", "bare_write"), ("read", "bare_read")]
            if "bare_scatter" in per:
                pairs.append(("write", "bare_scatter"))
            for n, bare in pairs:
                key = n if bare != "bare_scatter" else "write_over_scatter"
                row[f"{key}_overhead_us"] = statistics.median(a[0] - b[0] for a, b in zip(per[n], per[bare]))
                row[f"{key}_overhead_cpu_us"] = statistics.median(a[1] - b[1] for a, b in zip(per[n], per[bare]))
            out.append(row)
    return out
