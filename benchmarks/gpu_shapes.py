"""Row shapes beyond gpu_check's bf16 8 x 128 (benchmarks/gpu_session.py): store_kv,
gather_kv and copy_slots bandwidth for fp8, MLA's 576-wide latent, head_dim 64 and 72,
one KV head (a tensor-parallel rank), on page-16 caches; plus the global access
opcodes each compiled variant got on this device's Triton.

GB/s counts the bytes each op must move (store: read k, v + write both caches; gather:
read both caches + write both outputs; copy: read + write every row in every cache).
--device cpu is a dry run of the logic with tiny sizes (figures meaningless).
Writes JSON to --out after every shape, so a timeout keeps what ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from gpu_common import RUN, bench, log, ptx_accesses

FP8 = torch.float8_e4m3fn
# name -> (heads, head_dim, cache dtype, with V)
SHAPES = {
    "bf16_h8_d128": (8, 128, torch.bfloat16, True),
    "fp8_h8_d128": (8, 128, FP8, True),
    "bf16_h8_d64": (8, 64, torch.bfloat16, True),
    "fp8_h8_d64": (8, 64, FP8, True),
    "bf16_mla576": (1, 576, torch.bfloat16, False),
    "fp8_mla576": (1, 576, FP8, False),
    "bf16_h8_d72": (8, 72, torch.bfloat16, True),
    "bf16_h1_d128": (1, 128, torch.bfloat16, True),
}
PAGE = 16


def _one_shape(name: str, heads: int, dim: int, dtype: torch.dtype, with_v: bool, sizes: list[int],
               peak: float | None) -> dict[str, Any]:
    import kvpool.kernels as K

    dev = RUN.dev
    in_dt = torch.bfloat16
    num_slots = max(4 * max(sizes), 4096)
    # fp8 as zeroed bytes (as KVPool makes them): torch < 2.5 has no CPU fill for fp8, which the
    # dry run on the declared floor (2.4) hit; all-zero bits are +0.0 in every fp8 format.
    shape = (num_slots // PAGE, PAGE, heads, dim)
    caches = [torch.zeros(shape, dtype=torch.uint8, device=dev).view(dtype) if dtype == FP8
              else torch.zeros(shape, dtype=dtype, device=dev) for _ in range(2 if with_v else 1)]
    kc, vc = caches[0], (caches[1] if with_v else None)
    scale = torch.ones(1, device=dev) if dtype == FP8 else None
    row = heads * dim
    out: dict[str, Any] = {"heads": heads, "head_dim": dim, "dtype": str(dtype), "page": PAGE, "rows": []}
    for n in sizes:
        perm = torch.randperm(num_slots, device=dev)
        slots, src, dst = perm[:n].clone(), perm[n:2 * n].clone(), perm[2 * n:3 * n].clone()
        k = torch.randn((n, heads, dim), device=dev).to(in_dt)
        v = torch.randn((n, heads, dim), device=dev).to(in_dt) if with_v else None
        gk = torch.empty((n, heads, dim), dtype=in_dt if dtype == FP8 else dtype, device=dev)
        gv = torch.empty_like(gk) if with_v else None
        gather_kw = {"out_dtype": in_dt, "k_scale": scale, "v_scale": scale if with_v else None} if dtype == FP8 else {}
        tensors = len(caches)
        c_bytes, i_bytes, o_bytes = dtype.itemsize, in_dt.itemsize, gk.element_size()
        ops = {
            "store_kv": (lambda i: K.store_kv(kc, vc, slots, k, v, scale, scale if with_v else None),
                         n * row * tensors * (c_bytes + i_bytes)),
            "gather_kv": (lambda i: K.gather_kv(kc, vc, slots, out=(gk, gv), **gather_kw),
                          n * row * tensors * (c_bytes + o_bytes)),
            "copy_slots": (lambda i: K.copy_slots(caches, src, dst), 2 * n * row * tensors * c_bytes),
        }
        entry: dict[str, Any] = {"tokens": n}
        for op, (fn, moved) in ops.items():
            try:
                r = bench(fn, inner=20, reps=5)
                gbps = moved / (r["us"] * 1e-6) / 1e9
                entry[op] = {"us": round(r["us"], 3), "GBps": round(gbps, 1), "bytes": moved,
                             "pct_peak": round(100 * gbps / peak, 1) if peak else None, "timing": r["timing"]}
            except Exception as e:  # noqa: BLE001 - record and go on
                entry[op] = {"error": f"{type(e).__name__}: {e}"}
        out["rows"].append(entry)
        log(f"[shapes] {name:>14} {n:>6} tok: " + " | ".join(
            f"{op} {entry[op].get('us', float('nan')):8.2f} us {entry[op].get('GBps', 0):7.0f} GB/s" for op in ops))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--peak-gbps", type=float, default=None)
    args = ap.parse_args()
    RUN.dev, RUN.dry = args.device, args.device == "cpu"
    peak = args.peak_gbps
    if peak is None and not RUN.dry:
        from gpu_check import PEAKS_GBPS

        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAKS_GBPS.items() if k in name), None)
    sizes = [8] if RUN.dry else [256, 8192]
    report: dict[str, Any] = {"device": "cpu (dry run)" if RUN.dry else torch.cuda.get_device_name(),
                              "peak_GBps": peak, "shapes": {}}
    path = Path(args.out)
    ok = True
    for name, (heads, dim, dtype, with_v) in SHAPES.items():
        t0 = time.perf_counter()
        try:
            report["shapes"][name] = _one_shape(name, heads, dim, dtype, with_v, sizes, peak)
        except Exception as e:  # noqa: BLE001
            ok = False
            report["shapes"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            log(f"[shapes] {name} ERROR {type(e).__name__}: {e}")
        report["shapes"][name]["seconds"] = round(time.perf_counter() - t0, 2)
        path.write_text(json.dumps(report, indent=2, default=str))
    if not RUN.dry:
        from kvpool.kernels import copy, gather, store

        report["ptx"] = {op: ptx_accesses(fn) for op, fn in (
            ("store_kv", store._store_kv_kernel), ("gather_kv", gather._gather_kv_kernel),
            ("copy_slots", copy._copy_slots_kernel))}
    path.write_text(json.dumps(report, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
