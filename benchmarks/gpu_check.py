"""One-shot GPU check for kvpool's kernels and DecodeGraphRunner (< 5 min on an H200).

    python benchmarks/gpu_check.py [--out PATH] [--peak-gbps X]
    PYTHONPATH=python python benchmarks/gpu_check.py   # a checkout with _core built in place

Writes JSON to --out, else $OUT/gpu_check.json when $OUT is set, else
./gpu_check.json, and prints every figure. Sections (each isolated: an error is
recorded in the JSON and the next section still runs):
  correctness   kernels on CUDA vs the torch reference (all dtypes, layouts, padding)
  runner        capture + replay of a small decode step through KVPool at several
                batch sizes incl. padded ones, under inference_mode and no_grad:
                K/V in exactly the right slots, nothing else touched but page 0
  bandwidth     store_kv vs torch index_copy_ / indexed assignment, decode 1..256 and
                prefill 4k..32k tokens, GB/s and % of peak (each op timed as 50
                launches captured in one CUDA graph, median of reps)
  layer_store   per-layer store time inside a captured 32-layer graph, 256 tokens
  replay        replay time of a captured decode step vs the same step run eagerly
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch


DEV = "cuda"   # --device cpu: a dry run of the script's logic (figures meaningless)
DRY = False
PEAKS_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10": 600.0}
H, D = 8, 128  # Llama-3-8B-like KV heads x head_dim


def log(msg: str) -> None:
    print(msg, flush=True)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def bench(fn: Callable[[int], Any], inner: int = 50, reps: int = 7) -> Dict[str, Any]:
    """Median microseconds per fn(i) call: `inner` calls captured in one CUDA graph
    (launch overhead as in a captured decode step), falling back to eager launches."""
    for i in range(min(inner, 8)):  # compile every specialization before capturing
        fn(i)
    if DRY:
        t0 = time.perf_counter()
        fn(0)
        return {"us": (time.perf_counter() - t0) * 1e6, "timing": "dry run (cpu)"}
    torch.cuda.synchronize()
    how = "graph"
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(inner):
                fn(i)
        run: Callable[[], Any] = g.replay
    except Exception as e:  # noqa: BLE001 - record and time eagerly instead
        torch.cuda.synchronize()
        how = f"eager ({type(e).__name__}: {str(e)[:80]})"

        def run() -> None:
            for i in range(inner):
                fn(i)
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / inner)
    return {"us": statistics.median(times), "timing": how}


# ----- correctness -------------------------------------------------------------------

def section_correctness() -> Dict[str, Any]:
    import kvpool.kernels as K
    from kvpool.kernels import _ref
    from kvpool.testing.kernel_cases import StoreCase, build_store, clone_opt, same, untouched_equal

    fp8 = torch.float8_e4m3fn
    results: List[Dict[str, Any]] = []
    gen = torch.Generator().manual_seed(0)
    for layout, page in (("token", 1), ("paged", 16), ("interleaved", 1)):
        for cache_dt, in_dt in ((torch.float32, torch.float32), (torch.float16, torch.float16),
                                (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                (fp8, torch.bfloat16), (fp8, torch.float16)):
            for heads, dim in ((8, 128), (3, 96)):  # GQA-typical, and non-pow2 H and D
                for scale_kind in ("none", "tensor") if cache_dt == fp8 else ("none",):
                    n = 37
                    slots = torch.randperm(256, generator=gen)[:n].tolist()
                    slots = [-1 if i % 5 == 0 else s for i, s in enumerate(slots)]
                    case = StoreCase(layout, page, 256, heads, dim, cache_dt, in_dt, slots, scale_kind,
                                     True, torch.int32 if heads == 3 else torch.int64)
                    kc, vc, st, k, v, ks, vs = build_store(case, 7, device=DEV)
                    # Arbitrary (non-exact) inputs: on a GPU both sides round to nearest.
                    k.copy_(torch.randn(k.shape, device=DEV) * 3)
                    v.copy_(torch.randn(v.shape, device=DEV) * 3)
                    rk, rv, kc0 = kc.clone(), clone_opt(vc), kc.clone()
                    _ref.store_kv_ref(rk, rv, st, k, v, ks, vs)
                    K.store_kv(kc, vc, st, k, v, ks, vs)
                    ok = same(kc.cpu(), rk.cpu()) and same(vc.cpu(), rv.cpu()) \
                        and untouched_equal(kc0.cpu(), kc.cpu(), slots)
                    gk, gv = K.gather_kv(kc, vc, st)
                    ek, ev = _ref.gather_kv_ref(kc, vc, st)
                    ok_g = same(gk.cpu(), ek.cpu()) and same(gv.cpu(), ev.cpu())
                    results.append({"op": "store+gather", "layout": layout, "cache": str(cache_dt),
                                    "input": str(in_dt), "H": heads, "D": dim, "scale": scale_kind,
                                    "store_ok": ok, "gather_ok": ok_g})
    caches = [torch.randn((64, 16, H, D), device=DEV).half() for _ in range(8)]
    src = torch.tensor([17, 18, 19, -1, 900], device=DEV)
    dst = torch.tensor([500, 501, 502, 503, -1], device=DEV)
    ref = [t.clone() for t in caches]
    _ref.copy_slots_ref(ref, src, dst)
    K.copy_slots(caches, src, dst)
    results.append({"op": "copy_slots", "ok": all(torch.equal(a, b) for a, b in zip(caches, ref))})
    table = torch.zeros((65, 4096), dtype=torch.int32, device=DEV)
    counts = torch.randint(0, 300, (48,))
    rows = torch.randperm(64)[:48]
    starts = torch.randint(0, 3000, (48,))
    slots = torch.randint(1, 10**6, (int(counts.sum()),))
    want = table.cpu().clone()
    _ref.write_req_to_token_ref(want, rows, starts, counts, slots)
    K.write_req_to_token(table, rows.to(DEV), starts.to(DEV), counts.to(DEV), slots.to(DEV))
    results.append({"op": "write_req_to_token", "ok": torch.equal(table.cpu(), want)})
    failed = [r for r in results if not all(v for k, v in r.items() if k.endswith("ok"))]
    log(f"[correctness] {len(results) - len(failed)}/{len(results)} cases match torch")
    for r in failed:
        log(f"  MISMATCH {r}")
    return {"cases": results, "all_ok": not failed}


# ----- runner ------------------------------------------------------------------------

def _runner_pool(seed: int):
    import kvpool
    pool = kvpool.KVPool(3, 4, 64, dtype=torch.bfloat16, device=DEV, page_size=16, num_pages=512,
                         max_requests=64, max_context_len=256, layout="paged")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in pool.k_buffers + pool.v_buffers:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return pool


def section_runner() -> Dict[str, Any]:
    import numpy as np
    from kvpool.cuda_graph import DecodeGraphRunner
    from kvpool.testing.toy_step import ToyDecode

    out: Dict[str, Any] = {}
    for mode_name, ctx in (("inference_mode", torch.inference_mode), ("no_grad", torch.no_grad)):
        pool, twin = _runner_pool(1), _runner_pool(1)
        step, twin_step = ToyDecode(pool), ToyDecode(twin)
        runner = DecodeGraphRunner(pool, step, max_batch_size=32, debug=True)
        t0 = time.perf_counter()
        with ctx():
            runner.capture()
        cap_s = time.perf_counter() - t0
        checks = []
        rng = np.random.default_rng(0)
        for bs in (1, 3, 8, 13, 32):
            hs = [p.open(bs) for p in (pool, twin)]
            lens = rng.integers(1, 120, size=bs)
            for p, h in zip((pool, twin), hs):
                p.extend(h, lens)
            for it in range(2):
                res = [p.extend(h, 1) for p, h in zip((pool, twin), hs)]
                ln = pool.lengths(hs[0])
                ids = rng.integers(0, 64, size=bs)
                args = [(ids, ln - 1, p.rows(h), r.slots, ln) for p, h, r in zip((pool, twin), hs, res)]
                before = [t.clone() for t in pool.k_buffers + pool.v_buffers]
                with ctx():
                    got = runner.run(*args[0])
                    want = twin_step(*(torch.as_tensor(np.asarray(a, dtype=np.int64), device=DEV)
                                       for a in args[1]))
                sync()
                real = set(int(s) for s in res[0].slots)
                page0 = set(range(pool.page_size))
                untouched_ok, exact_l0 = True, True
                for t, t0_ in zip(pool.k_buffers + pool.v_buffers, before):
                    a, b = t.reshape(-1, 4, 64), t0_.reshape(-1, 4, 64)
                    keep = torch.ones(a.shape[0], dtype=torch.bool)
                    keep[sorted(real | page0)] = False
                    keep = keep.to(DEV)
                    untouched_ok &= torch.equal(a[keep], b[keep])
                # Layer 0's K/V are an elementwise function of the inputs: exact check.
                x = step.emb[torch.as_tensor(ids, device=DEV)]
                k0, v0 = step.kv(x, torch.as_tensor(ln - 1, device=DEV), 0)
                sl = torch.as_tensor(res[0].slots, device=DEV)
                exact_l0 = torch.equal(pool.k_buffer(0).reshape(-1, 4, 64)[sl], k0) and \
                    torch.equal(pool.v_buffer(0).reshape(-1, 4, 64)[sl], v0)
                close = torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
                checks.append({"batch": bs, "bucket": runner.bucket_for(bs), "iter": it,
                               "layer0_kv_exact": bool(exact_l0), "others_untouched": bool(untouched_ok),
                               "logits_match_eager": bool(close),
                               "output_is_inference": bool(got.is_inference())})
            for p, h in zip((pool, twin), hs):
                p.close(h)
        ok = all(c["layer0_kv_exact"] and c["others_untouched"] and c["logits_match_eager"]
                 and c["output_is_inference"] == (mode_name == "inference_mode") for c in checks)
        out[mode_name] = {"capture_s": cap_s, "buckets": runner.buckets, "checks": checks, "ok": ok}
        log(f"[runner:{mode_name}] captured {len(runner.captured)} buckets in {cap_s:.1f}s; "
            f"{sum(1 for c in checks)} replays, all correct: {ok}")
    return out


# ----- bandwidth ---------------------------------------------------------------------

def section_bandwidth(peak: float | None) -> Dict[str, Any]:
    import kvpool.kernels as K
    from kvpool.kernels import store as store_mod

    rows: List[Dict[str, Any]] = []
    dt = torch.bfloat16
    row_bytes = H * D * dt.itemsize
    sizes = (1, 8, 2048) if DRY else (1, 2, 4, 8, 16, 32, 64, 128, 256, 4096, 8192, 16384, 32768)
    for n in sizes:
        # Rotate inputs/slots so that big sizes stream from HBM, not L2.
        rot = max(1, min(8, math.ceil(256e6 / (2 * n * row_bytes))))
        num_slots = max(rot * n, 4096)
        kc = torch.zeros((num_slots, H, D), dtype=dt, device=DEV)
        vc = torch.zeros_like(kc)
        perm = torch.randperm(num_slots, device=DEV)
        # clone(): each its own allocation, so every launch has the same 16-byte
        # alignment (and Triton specialization) as the warm-up ones.
        slots = [perm[i * n:(i + 1) * n].clone() for i in range(rot)]
        ks = [torch.randn((n, H, D), device=DEV, dtype=dt) for _ in range(rot)]
        vs = [torch.randn((n, H, D), device=DEV, dtype=dt) for _ in range(rot)]
        moved = 4 * n * row_bytes + n * 8  # read k, v + write k, v rows + slot ids
        ops = {
            "store_kv": lambda i: K.store_kv(kc, vc, slots[i % rot], ks[i % rot], vs[i % rot]),
            "torch_index_copy_": lambda i: (kc.index_copy_(0, slots[i % rot], ks[i % rot]),
                                            vc.index_copy_(0, slots[i % rot], vs[i % rot])),
            "torch_indexed_assign": lambda i: (kc.__setitem__(slots[i % rot], ks[i % rot]),
                                               vc.__setitem__(slots[i % rot], vs[i % rot])),
        }
        entry: Dict[str, Any] = {"tokens": n, "bytes": moved}
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
        if DEV == "cuda":
            torch.cuda.empty_cache()
    beats = all(r["store_kv"].get("us", 1e9) <= min(r["torch_index_copy_"].get("us", 1e9),
                                                    r["torch_indexed_assign"].get("us", 1e9)) for r in rows)
    prefill = [r["store_kv"].get("pct_peak") for r in rows if r["tokens"] >= 4096]
    return {"dtype": str(dt), "H": H, "D": D, "rows": rows, "store_at_least_as_fast_as_torch": beats,
            "prefill_min_pct_peak": min(prefill) if prefill and all(p is not None for p in prefill) else None}


def section_copy_reference() -> Dict[str, Any]:
    """Plain device-to-device copy bandwidth: what this GPU actually sustains."""
    src = torch.empty(2**20 if DRY else 2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    r = bench(lambda i: dst.copy_(src), inner=10, reps=5)
    gbps = 2 * src.numel() / (r["us"] * 1e-6) / 1e9
    log(f"[copy reference] {src.numel() >> 20} MiB device copy: {gbps:.0f} GB/s (read + write)")
    return {"GBps": gbps, "us": r["us"]}


def section_layer_store(layers: int = 32, n: int = 256) -> Dict[str, Any]:
    import kvpool.kernels as K

    dt = torch.bfloat16
    kcs = [torch.zeros((8192, H, D), dtype=dt, device=DEV) for _ in range(layers)]
    vcs = [torch.zeros_like(c) for c in kcs]
    ks = [torch.randn((n, H, D), dtype=dt, device=DEV) for _ in range(layers)]
    vs = [torch.randn((n, H, D), dtype=dt, device=DEV) for _ in range(layers)]
    slots = torch.randperm(8192, device=DEV)[:n]
    out: Dict[str, Any] = {"layers": layers, "tokens": n}
    for name, one in (("store_kv", lambda l: K.store_kv(kcs[l], vcs[l], slots, ks[l], vs[l])),
                      ("torch_index_copy_", lambda l: (kcs[l].index_copy_(0, slots, ks[l]),
                                                       vcs[l].index_copy_(0, slots, vs[l])))):
        r = bench(one, inner=layers, reps=11)
        out[name] = {"us_per_layer": r["us"], "timing": r["timing"]}
        log(f"[layer store] {name}: {r['us']:.2f} us per layer ({n} tokens, {layers} layers in one graph)")
    out["target_us"] = 2.0
    out["meets_target"] = out["store_kv"]["us_per_layer"] <= 2.0
    return out


def section_replay(bs: int = 32, iters: int = 50) -> Dict[str, Any]:
    import numpy as np
    import kvpool
    from kvpool.cuda_graph import DecodeGraphRunner
    from kvpool.testing.toy_step import ToyDecode

    pool = kvpool.KVPool(2 if DRY else 16, 8, 128, dtype=torch.bfloat16, device=DEV, page_size=16, num_pages=1024,
                         max_requests=64, max_context_len=128)
    step = ToyDecode(pool)
    h = pool.open(bs)
    pool.extend(h, 64)
    res = pool.extend(h, 1)
    ln = pool.lengths(h)
    host = (np.zeros(bs, dtype=np.int64), ln - 1, pool.rows(h), res.slots, ln)
    dev = tuple(torch.as_tensor(np.asarray(a, dtype=np.int64), device=DEV) for a in host)
    runner = DecodeGraphRunner(pool, step, max_batch_size=bs, buckets=[bs])
    out: Dict[str, Any] = {"batch": bs, "layers": pool.num_layers}
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
        if not DRY:
            graph, _ = runner._graphs[("inference_mode", bs)]
            out["graph_replay_us"] = timed(graph.replay)
    out["speedup_run_vs_eager"] = out["eager_step_us"] / out["runner_run_us"]
    log(f"[replay] batch {bs}, {pool.num_layers} layers: eager {out['eager_step_us']:.0f} us, "
        f"runner.run {out['runner_run_us']:.0f} us, bare replay {out.get('graph_replay_us', -1):.0f} us "
        f"({out['speedup_run_vs_eager']:.1f}x)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_check.json or ./gpu_check.json)")
    ap.add_argument("--peak-gbps", type=float, default=None, help="device peak memory bandwidth, GB/s")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu = dry run of the logic with tiny sizes (no timings worth reading)")
    ap.add_argument("--budget-s", type=float, default=230.0,
                    help="start no new section after this many seconds (default 230)")
    args = ap.parse_args()
    out_path = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    report: Dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    global DEV, DRY
    DEV, DRY = args.device, args.device == "cpu"
    if DRY:
        log("DRY RUN on cpu: checks the script's logic only; figures are meaningless")
    elif not torch.cuda.is_available():
        report["error"] = "no CUDA device"
        log("no CUDA device: nothing to check")
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=2))
        return 2
    import triton
    name = torch.cuda.get_device_name() if not DRY else "cpu (dry run)"
    peak = args.peak_gbps or next((v for k, v in PEAKS_GBPS.items() if k in name), None)
    report["device"] = {"name": name, "torch": torch.__version__, "triton": triton.__version__,
                        "peak_GBps": peak, "dry_run": DRY,
                        "capability": list(torch.cuda.get_device_capability()) if not DRY else None}
    log(f"device: {name}, peak {peak} GB/s, torch {torch.__version__}, triton {triton.__version__}")
    t_all = time.perf_counter()
    sections: Dict[str, Callable[[], Any]] = {
        "correctness": section_correctness,
        "runner": section_runner,
        "bandwidth": lambda: section_bandwidth(peak),
        "layer_store": (lambda: section_layer_store(2, 16)) if DRY else section_layer_store,
        "replay": (lambda: section_replay(4, 2)) if DRY else section_replay,
        "copy_reference": section_copy_reference,
    }
    for key, fn in sections.items():
        t0 = time.perf_counter()
        if t0 - t_all > args.budget_s:  # stay inside the caller's time slot
            report[key] = {"skipped": f"time budget {args.budget_s}s spent"}
            log(f"[{key}] skipped: time budget spent")
            continue
        try:
            report[key] = fn()
        except Exception as e:  # noqa: BLE001 - keep going, record what broke
            report[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            log(f"[{key}] ERROR {type(e).__name__}: {e}")
            try:
                sync()
            except Exception:  # noqa: BLE001
                pass
        report.setdefault("seconds", {})[key] = round(time.perf_counter() - t0, 2)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=2, default=str))  # partial results survive a crash
    report["total_s"] = round(time.perf_counter() - t_all, 1)
    out_path.write_text(json.dumps(report, indent=2, default=str))
    log(f"wrote {out_path} ({report['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
