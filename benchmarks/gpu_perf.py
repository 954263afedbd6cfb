"""Performance sections of benchmarks/gpu_check.py: store bandwidth against torch,
per-layer store cost inside a captured graph, replay vs eager, the device's own copy
bandwidth, and the PTX the kernels were compiled to on this machine."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gpu_common import RUN, bench, log, ptx_accesses, sync

H, D = 8, 128  # Llama-3-8B-like KV heads x head_dim


# ----- bandwidth ---------------------------------------------------------------------

def section_bandwidth(peak: float | None) -> dict[str, Any]:
    import kvpool.kernels as K
    from kvpool.kernels import store as store_mod

    rows: list[dict[str, Any]] = []
    dt = torch.bfloat16
    row_bytes = H * D * dt.itemsize
    sizes = (1, 8, 2048) if RUN.dry else (1, 2, 4, 8, 16, 32, 64, 128, 256, 4096, 8192, 16384, 32768)
    for n in sizes:
        # Rotate inputs/slots so that big sizes stream from HBM, not L2.
        rot = max(1, min(8, math.ceil(256e6 / (2 * n * row_bytes))))
        num_slots = max(rot * n, 4096)
        kc = torch.zeros((num_slots, H, D), dtype=dt, device=RUN.dev)
        vc = torch.zeros_like(kc)
        perm = torch.randperm(num_slots, device=RUN.dev)
        # clone(): each its own allocation, so every launch has the same 16-byte
        # alignment (and Triton specialization) as the warm-up ones.
        slots = [perm[i * n:(i + 1) * n].clone() for i in range(rot)]
        ks = [torch.randn((n, H, D), device=RUN.dev, dtype=dt) for _ in range(rot)]
        vs = [torch.randn((n, H, D), device=RUN.dev, dtype=dt) for _ in range(rot)]
        moved = 4 * n * row_bytes + n * 8  # read k, v + write k, v rows + slot ids
        ops = {
            "store_kv": lambda i: K.store_kv(kc, vc, slots[i % rot], ks[i % rot], vs[i % rot]),
            "torch_index_copy_": lambda i: (kc.index_copy_(0, slots[i % rot], ks[i % rot]),
                                            vc.index_copy_(0, slots[i % rot], vs[i % rot])),
            "torch_indexed_assign": lambda i: (kc.__setitem__(slots[i % rot], ks[i % rot]),
                                               vc.__setitem__(slots[i % rot], vs[i % rot])),
        }
        entry: dict[str, Any] = {"tokens": n, "bytes": moved}
        for name, fn in ops.items():
            try:
                r = bench(fn)
                gbps = moved / (r["us"] * 1e-6) / 1e9
                entry[name] = {"us": r["us"], "GBps": gbps, "pct_peak": 100 * gbps / peak if peak else None,
                               "timing": r["timing"]}
            except Exception as e:  # noqa: BLE001
                entry[name] = {"error": f"{type(e).__name__}: {e}"}
        if n >= 2048:  # diagnostic: one token per program instead of several
            orig = store_mod.rows_per_program
            try:
                store_mod.rows_per_program = lambda *_: 1
                r = bench(ops["store_kv"])
                entry["store_kv_rows1"] = {"us": r["us"], "GBps": moved / (r["us"] * 1e-6) / 1e9}
            finally:
                store_mod.rows_per_program = orig
        rows.append(entry)
        s, ic, ia = (entry[k] for k in ops)
        pct = f" ({s['pct_peak']:.0f}% of peak)" if s.get("pct_peak") else ""
        log(f"[bandwidth] {n:>6} tok: store_kv {s.get('us', float('nan')):8.2f} us {s.get('GBps', 0):7.0f} GB/s"
            f"{pct} | index_copy_ {ic.get('us', float('nan')):8.2f} us | assign {ia.get('us', float('nan')):8.2f} us")
        del kc, vc, ks, vs, slots
        if RUN.dev == "cuda":
            torch.cuda.empty_cache()
    beats = all(r["store_kv"].get("us", 1e9) <= min(r["torch_index_copy_"].get("us", 1e9),
                                                    r["torch_indexed_assign"].get("us", 1e9)) for r in rows)
    prefill = [r["store_kv"].get("pct_peak") for r in rows if r["tokens"] >= 4096]
    return {"dtype": str(dt), "H": H, "D": D, "rows": rows, "store_at_least_as_fast_as_torch": beats,
            "prefill_min_pct_peak": min(prefill) if prefill and all(p is not None for p in prefill) else None}


def section_copy_reference() -> dict[str, Any]:
    """Plain device-to-device copy bandwidth: what this GPU actually sustains."""
    src = torch.empty(2**20 if RUN.dry else 2**30, dtype=torch.uint8, device=RUN.dev)
    dst = torch.empty_like(src)
    r = bench(lambda i: dst.copy_(src), inner=10, reps=5)
    gbps = 2 * src.numel() / (r["us"] * 1e-6) / 1e9
    log(f"[copy reference] {src.numel() >> 20} MiB device copy: {gbps:.0f} GB/s (read + write)")
    return {"GBps": gbps, "us": r["us"]}


def section_layer_store(layers: int = 32, n: int = 256) -> dict[str, Any]:
    import kvpool.kernels as K

    dt = torch.bfloat16
    kcs = [torch.zeros((8192, H, D), dtype=dt, device=RUN.dev) for _ in range(layers)]
    vcs = [torch.zeros_like(c) for c in kcs]
    ks = [torch.randn((n, H, D), dtype=dt, device=RUN.dev) for _ in range(layers)]
    vs = [torch.randn((n, H, D), dtype=dt, device=RUN.dev) for _ in range(layers)]
    slots = torch.randperm(8192, device=RUN.dev)[:n]
    out: dict[str, Any] = {"layers": layers, "tokens": n}
    for name, one in (("store_kv", lambda layer: K.store_kv(kcs[layer], vcs[layer], slots, ks[layer], vs[layer])),
                      ("torch_index_copy_", lambda layer: (kcs[layer].index_copy_(0, slots, ks[layer]),
                                                       vcs[layer].index_copy_(0, slots, vs[layer])))):
        r = bench(one, inner=layers, reps=11)
        out[name] = {"us_per_layer": r["us"], "timing": r["timing"]}
        log(f"[layer store] {name}: {r['us']:.2f} us per layer ({n} tokens, {layers} layers in one graph)")
    out["target_us"] = 2.0
    out["meets_target"] = out["store_kv"]["us_per_layer"] <= 2.0
    return out


def section_replay(toy_decode, bs: int = 32, iters: int = 50) -> dict[str, Any]:
    import kvpool
    from kvpool.cuda_graph import DecodeGraphRunner

    pool = kvpool.KVPool(2 if RUN.dry else 16, 8, 128, dtype=torch.bfloat16, device=RUN.dev, page_size=16,
                         num_pages=1024, max_requests=64, max_context_len=128)
    step = toy_decode(pool)
    h = pool.open(bs)
    pool.extend(h, 64)
    res = pool.extend(h, 1)
    ln = pool.lengths(h)
    host = (np.zeros(bs, dtype=np.int64), ln - 1, pool.rows(h), res.slots, ln)
    dev = tuple(torch.as_tensor(np.asarray(a, dtype=np.int64), device=RUN.dev) for a in host)
    runner = DecodeGraphRunner(pool, step, max_batch_size=bs, buckets=[bs])
    out: dict[str, Any] = {"batch": bs, "layers": pool.num_layers}
    with torch.inference_mode():
        runner.capture()

        def timed(fn: Callable[[], Any]) -> float:
            for _ in range(3):
                fn()
            sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            sync()
            return (time.perf_counter() - t0) / iters * 1e6

        out["eager_step_us"] = timed(lambda: step(*dev))
        out["runner_run_us"] = timed(lambda: runner.run(*host))  # incl. pinned staging + H2D
        if not RUN.dry:
            graph, _ = runner._graphs[("inference_mode", bs)]
            out["graph_replay_us"] = timed(graph.replay)
    out["speedup_run_vs_eager"] = out["eager_step_us"] / out["runner_run_us"]
    log(f"[replay] batch {bs}, {pool.num_layers} layers: eager {out['eager_step_us']:.0f} us, "
        f"runner.run {out['runner_run_us']:.0f} us, bare replay {out.get('graph_replay_us', -1):.0f} us "
        f"({out['speedup_run_vs_eager']:.1f}x)")
    return out


def section_ptx() -> dict[str, Any]:
    """Global access opcodes of every kernel variant this run compiled (16-byte
    ld/st.global.v4.b32 expected for 16-bit K/V rows; see tests/test_kernels_codegen.py)."""
    if RUN.dry:
        return {"skipped": "dry run: nothing compiled for a GPU"}
    from kvpool.kernels import copy, gather, req_table, store

    out = {name: ptx_accesses(fn) for name, fn in (
        ("store_kv", store._store_kv_kernel), ("gather_kv", gather._gather_kv_kernel),
        ("copy_slots", copy._copy_slots_kernel), ("write_req_to_token", req_table._write_req_to_token_kernel))}
    for name, variants in out.items():
        merged: dict[str, int] = {}
        for v in variants:
            for op, k in v["accesses"].items():
                merged[op] = merged.get(op, 0) + k
        log(f"[ptx] {name}: {len(variants)} variants, accesses {merged}")
    return out


def section_nccl_transfer() -> dict[str, Any]:
    """Request transfer between two pools on two GPUs over NCCL (benchmarks/bench_transfer.py).
    NEEDS >= 2 GPUs: on a one-GPU machine it records why it was skipped."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    n = torch.cuda.device_count() if not RUN.dry else 0
    if n < 2:
        log(f"[nccl_transfer] skipped: needs >= 2 GPUs, found {n}")
        return {"skipped": f"needs >= 2 GPUs, found {n}"}
    out = Path(os.environ.get("OUT", ".")) / "transfer_nccl.json"
    script = Path(__file__).resolve().parent / "bench_transfer.py"
    cmd = [sys.executable, str(script), "--backend", "nccl", "--layers", "32",
           "--lengths", "512,2048,8192,32768", "--out", str(out), "--timeout-s", "120"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    log(proc.stdout[-3000:] + proc.stderr[-2000:])
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}", "stderr": proc.stderr[-2000:]}
    return json.loads(out.read_text())
