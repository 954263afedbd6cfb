"""Where an eager ``KVPool.write`` spends its host time on a GPU (the GPU session's
``launch`` section): the whole call against its parts (``layer_stores``, the pool's own
store; ``store_rows``, the generic one; ``launch_store_kv``), against two bare ``index_copy_``, a bare torch op and empty Triton
kernels, and against Triton's own ``kernel[grid]`` path for the same arguments, its
binder, its cache key and the compiled launcher alone; plus a cProfile of the call. Also
``write_req_to_token`` for a decode batch of 256 (the launch a device pool's ``extend``
makes every step) through its kept compiled kernel and through Triton's own path.

Host µs per call, median and p90, the GPU synchronised (untimed) every few calls so that
no figure waits on a full launch queue. ``--device cpu`` is a dry run of the logic (a
CPU pool, the Triton probes skipped). Writes JSON to --out.
    PYTHONPATH=python python3 benchmarks/gpu_launch.py --out launch.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]
from gpu_common import RUN, log, sync


@triton.jit
def _empty1(a):
    pass


@triton.jit
def _empty30(a, b, c, d, e, n, H, D, P, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13,
             s14, s15, s16, X: tl.constexpr, Y: tl.constexpr, Z: tl.constexpr, W: tl.constexpr):
    pass


def host_us(fn: Callable[[], Any], n: int, sync_every: int = 20) -> dict[str, float]:
    for _ in range(min(n, 30)):
        fn()
    sync()
    ts = []
    for i in range(n):
        if i % sync_every == 0:
            sync()
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    sync()
    ts.sort()
    return {"median_us": round(statistics.median(ts) / 1e3, 2), "p90_us": round(ts[int(0.9 * (n - 1))] / 1e3, 2),
            "min_us": round(ts[0] / 1e3, 2)}


def _triton_parts(tag: str, caches, loc, k, v, geom, scales, kf, rec, out: dict[str, Any]) -> None:
    """Triton's kernel[grid] path for the arguments launch_store_kv passes, and its pieces."""
    from triton import knobs  # type: ignore[import-untyped]
    from triton.runtime.jit import compute_cache_key  # type: ignore[import-untyped]

    from kvpool.kernels import store as st

    seen: dict[str, Any] = {}
    kernel = st._store_kv_kernel
    real = kernel.run

    def spy(*a, grid, warmup, **kw):
        seen.update(a=a, grid=grid, kw=kw)
        return real(*a, grid=grid, warmup=warmup, **kw)

    kernel.run = spy
    st._LAUNCH.clear()  # so that the next launch goes through Triton's path once
    try:
        st.launch_store_kv(caches[0], caches[1], loc, k, v, geom[0], geom[1], True, *scales)
    finally:
        del kernel.run
    ka, grid, kw = seen["a"], seen["grid"], seen["kw"]
    rec(f"{tag}:triton_kernel_getitem_call", lambda: kernel[grid](*ka, **kw))
    kernel_cache, key_cache, _target, _backend, binder = kernel.device_caches[torch.cuda.current_device()]
    kw2 = dict(kw, debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode)
    rec(f"{tag}:triton_binder", lambda: binder(*ka, **kw2))
    bound, spec, opts = binder(*ka, **kw2)
    rec(f"{tag}:triton_cache_key", lambda: compute_cache_key(key_cache, spec, opts))
    compiled = kernel_cache[compute_cache_key(key_cache, spec, opts)]
    vals = tuple(bound.values())
    run, fn_, meta = compiled.run, compiled.function, compiled.packed_metadata
    g0, g1 = grid[0], grid[1] if len(grid) > 1 else 1
    stream = torch.cuda.current_stream().cuda_stream
    rec(f"{tag}:triton_launcher_only", lambda: run(g0, g1, 1, stream, fn_, meta, None, None, None, *vals))
    # The launcher stores what Triton's path stores.
    kf.zero_()
    run(g0, g1, 1, stream, fn_, meta, None, None, None, *vals)
    direct = kf.clone()
    kf.zero_()
    kernel[grid](*ka, **kw)
    out[f"{tag}:launcher_bitwise_same"] = bool(torch.equal(direct, kf)) and bool(direct.abs().sum() > 0)


def measure(dev: str, calls: int) -> dict[str, Any]:
    import kvpool
    from kvpool.kernels import ops
    from kvpool.kernels import store as st

    out: dict[str, Any] = {"device": dev, "launch_mode": os.environ.get("KVPOOL_TRITON_LAUNCH", "compiled"),
                           "check_launch": os.environ.get("KVPOOL_CHECK_LAUNCH", "")}

    def rec(name: str, fn: Callable[[], Any]) -> None:
        try:
            out[name] = host_us(fn, calls)
        except Exception as e:  # one failed probe must not lose the others
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        log(f"[launch] {name:>36}: {out[name]}")

    x = torch.zeros(16, device=dev)
    rec("torch_zero_", lambda: x.zero_())
    if not RUN.dry:
        ints = [1, 8, 128, 16] + [1024 * (i + 1) for i in range(16)]
        rec("triton_empty_1arg", lambda: _empty1[(1,)](x))
        rec("triton_empty_30args", lambda: _empty30[(1,)](x, x, x, x, x, *ints, X=1, Y=2, Z=3, W=4))
    for layout, page in (("token", 1), ("paged", 16)):
        for rows in (1, 64):
            tag = f"{layout}_x{rows}"
            pool = kvpool.KVPool(2, 8, 128, dtype=torch.bfloat16, device=dev, page_size=page,
                                 num_pages=rows + 2, max_requests=rows, max_context_len=16, layout=layout,
                                 kv_events=False)
            loc = pool.extend(pool.open(rows), 1).out_cache_loc
            k = torch.randn(rows, 8, 128, device=dev).to(torch.bfloat16)
            v = torch.randn(rows, 8, 128, device=dev).to(torch.bfloat16)
            kf = pool.k_buffer(0).reshape(-1, 8, 128)
            vf = pool.v_buffer(0).reshape(-1, 8, 128)
            rec(f"{tag}:write", lambda: pool.write(0, loc, k, v))
            rec(f"{tag}:bare_index_copy_x2", lambda: (kf.index_copy_(0, loc, k), vf.index_copy_(0, loc, v)))
            rec(f"{tag}:read", lambda: pool.read(0, loc))
            rec(f"{tag}:bare_index_select_x2", lambda: (kf.index_select(0, loc), vf.index_select(0, loc)))
            if RUN.dry:
                continue
            caches, scales, geom = pool._row_caches[0], pool._row_scales[0], pool._row_geom
            rec(f"{tag}:store_rows", lambda: ops.store_rows(caches[0], caches[1], loc, k, v, scales[0], scales[1],
                                                             geom[0], geom[1]))
            rec(f"{tag}:layer_stores", lambda: pool._row_stores.store(0, loc, k, v))  # write's own store
            rec(f"{tag}:launch_store_kv", lambda: st.launch_store_kv(caches[0], caches[1], loc, k, v, geom[0],
                                                                     geom[1], True, scales[0], scales[1]))
            try:
                _triton_parts(tag, caches, loc, k, v, geom, scales, kf, rec, out)
            except Exception as e:  # Triton internals differ: the pool's own figures still stand
                out[f"{tag}:triton_internals"] = f"{type(e).__name__}: {e}"
                log(out[f"{tag}:triton_internals"])
            if tag == "token_x1":
                prof = cProfile.Profile()
                prof.enable()
                for i in range(calls * 5):
                    pool.write(0, loc, k, v)
                    if i % 20 == 0:
                        sync()
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
                out["cprofile_write_token_x1"] = s.getvalue()
    _table_launch(dev, rec)
    return out


def _table_launch(dev: str, rec: Callable[[str, Callable[[], Any]], None]) -> None:
    """``write_req_to_token`` of one slot for each of 256 requests: through the kept compiled
    kernel (``kvpool.kernels.launch``) and, on a GPU, through Triton's ``kernel[grid]``."""
    from kvpool.kernels import ops

    b = 256
    table = torch.zeros((b, 64), dtype=torch.int32, device=dev)
    rows, slots = torch.arange(b, device=dev), torch.arange(b, device=dev)
    starts, counts = torch.zeros(b, dtype=torch.int64, device=dev), torch.ones(b, dtype=torch.int64, device=dev)
    rec("table_b256:write_req_to_token", lambda: ops.write_req_to_token(table, rows, starts, counts, slots))
    if RUN.dry:
        return
    from kvpool.kernels import req_table

    kept = req_table._LAUNCH.enabled
    req_table._LAUNCH.enabled = False  # Triton's own path for the same call
    try:
        rec("table_b256:write_req_to_token_triton_path",
            lambda: ops.write_req_to_token(table, rows, starts, counts, slots))
    finally:
        req_table._LAUNCH.enabled = kept


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--calls", type=int, default=None, help="timed calls per figure (600; 20 on cpu)")
    args = ap.parse_args()
    RUN.dev, RUN.dry = args.device, args.device == "cpu"
    report = measure(args.device, args.calls or (20 if RUN.dry else 600))
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
