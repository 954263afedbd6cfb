"""Preflight of a GPU session (benchmarks/gpu_session.py): does the carried _core load,
does Triton compile and run the store kernel on this device, and do the bytes land?

KVPool.write (store_kv) of a bf16 and an fp8 pool, read back (gather_kv) and compared
bitwise with what was written (fp8: with the reference conversion); then extend and
the req_to_token row. Seconds to the first compiled launch are recorded (a cold
Triton cache compiles here). Writes JSON to --out; exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _pool_check(dev: str, dtype: torch.dtype) -> dict[str, Any]:
    import kvpool
    from kvpool.kernels import _ref

    pool = kvpool.KVPool(2, 8, 128, dtype=dtype, device=dev, page_size=16, num_pages=64,
                         max_requests=8, max_context_len=256)
    t0 = time.perf_counter()
    h = pool.open(2)
    res = pool.extend(h, [5, 9])
    gen = torch.Generator().manual_seed(0)
    n = len(res.slots)
    k = torch.randn((n, 8, 128), generator=gen).to(dev, pool.compute_dtype)
    v = torch.randn((n, 8, 128), generator=gen).to(dev, pool.compute_dtype)
    pool.write(1, res.out_cache_loc, k, v)
    got_k, got_v = pool.read(1, res.slots)
    if dev == "cuda":
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    if dtype == torch.float8_e4m3fn:  # what the cache holds: the reference conversion
        want_k = torch.empty((n, 8, 128), dtype=dtype, device=dev)
        want_v = torch.empty_like(want_k)
        idx = torch.arange(n, device=dev)
        _ref.store_kv_ref(want_k, want_v, idx, k, v, pool.k_scale[1], pool.v_scale[1])
        want_k, want_v = _ref.gather_kv_ref(want_k, want_v, idx, pool.compute_dtype,
                                            pool.k_scale[1], pool.v_scale[1])
    else:
        want_k, want_v = k, v
    bits = lambda t: t.contiguous().view(torch.uint8).cpu()  # noqa: E731
    rows = pool.rows(h)
    table_ok = all(
        pool.req_to_token[int(r), :ln].cpu().tolist() == pool.slots(int(x)).tolist()
        for r, x, ln in zip(rows, h, (5, 9))
    )
    return {"dtype": str(dtype), "first_launch_s": round(first_s, 2),
            "kv_bitwise": bool(torch.equal(bits(got_k), bits(want_k)) and torch.equal(bits(got_v), bits(want_v))),
            "req_to_token_ok": bool(table_ok), "slots": np.asarray(res.slots).tolist()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    out: dict[str, Any] = {"device": args.device}
    ok = True
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        try:
            r = _pool_check(args.device, dtype)
            r["ok"] = r["kv_bitwise"] and r["req_to_token_ok"]
        except Exception as e:  # noqa: BLE001 - record it; the session goes on
            import traceback

            r = {"dtype": str(dtype), "ok": False, "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc()[-3000:]}
        ok = ok and r["ok"]
        out[str(dtype)] = r
        print(json.dumps(r, default=str), flush=True)
    out["ok"] = ok
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
