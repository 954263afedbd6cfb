"""Correctness sections of benchmarks/gpu_check.py: compiled kernels vs the torch
reference, copy_slots replayed from a graph, the decode-graph runner, "no pool call
syncs the device", and (once the pool shares pages) copy-on-write and prefix rows."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from gpu_common import RUN, log, sync

FP8 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8).cpu()


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _garbage(shape, dtype, gen) -> torch.Tensor:
    """Random bytes (NaN/inf included) so a stray write anywhere is visible bitwise."""
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).to(RUN.dev)


def _caches(layout: str, slots: int, heads: int, dim: int, dtype, gen):
    if layout == "token":
        return _garbage((slots, heads, dim), dtype, gen), _garbage((slots, heads, dim), dtype, gen)
    if layout == "paged":
        return (_garbage((slots // 16, 16, heads, dim), dtype, gen),
                _garbage((slots // 16, 16, heads, dim), dtype, gen))
    buf = _garbage((slots, 2, heads, dim), dtype, gen)  # K/V interleaved in one buffer
    return buf[:, 0], buf[:, 1]


# (cache dtype, input dtype, scale): a float scale that is not a power of two checks
# that the reference divides exactly like the kernel's div_rn.
STORE_KINDS = [
    (torch.float16, torch.float16, None), (torch.bfloat16, torch.bfloat16, None),
    (torch.bfloat16, torch.float32, None), (FP8, torch.bfloat16, "tensor"), (FP8, torch.float16, 0.37),
]


def section_correctness() -> dict[str, Any]:
    import kvpool.kernels as K
    from kvpool.kernels import _ref

    results: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(0)
    cases = [(lay, kind, hd) for lay in ("token", "paged") for kind in STORE_KINDS
             for hd in ((8, 128), (3, 96)) if hd == (8, 128) or kind[0] != torch.float16]
    cases += [("interleaved", STORE_KINDS[1], (8, 128))]
    for layout, (cache_dt, in_dt, scale_kind), (heads, dim) in cases:
        n = 37
        slots_l = torch.randperm(256, generator=gen)[:n].tolist()
        slots_l = [-1 if i % 5 == 0 else s for i, s in enumerate(slots_l)]
        kc, vc = _caches(layout, 256, heads, dim, cache_dt, gen)
        st = torch.tensor(slots_l, dtype=torch.int32 if heads == 3 else torch.int64, device=RUN.dev)
        k = (torch.randn((n, heads, dim), generator=gen) * 3).to(RUN.dev, in_dt)
        v = (torch.randn((n, heads, dim), generator=gen) * 3).to(RUN.dev, in_dt)
        scale = torch.tensor([0.5], device=RUN.dev) if scale_kind == "tensor" else scale_kind
        rk, rv, kc0 = kc.clone(), vc.clone(), kc.clone()
        _ref.store_kv_ref(rk, rv, st, k, v, scale, scale)
        K.store_kv(kc, vc, st, k, v, scale, scale)
        written = {s for s in slots_l if s >= 0}
        flat0, flat1 = kc0.reshape(-1, heads, dim), kc.reshape(-1, heads, dim)
        keep = torch.tensor([s not in written for s in range(256)], device=RUN.dev)
        # Masked as bytes: torch 2.6's CPU has no boolean indexing of fp8 ("index_cpu" not implemented).
        ok = _same(kc, rk) and _same(vc, rv) and _same(flat0.view(torch.uint8)[keep], flat1.view(torch.uint8)[keep])
        gk, gv = K.gather_kv(kc, vc, st)
        ek, ev = _ref.gather_kv_ref(kc, vc, st)
        results.append({"op": "store+gather", "layout": layout, "cache": str(cache_dt), "input": str(in_dt),
                        "H": heads, "D": dim, "scale": str(scale_kind), "store_ok": ok,
                        "gather_ok": _same(gk, ek) and _same(gv, ev)})
    caches = [torch.randn((64, 16, 8, 128), generator=gen).half().to(RUN.dev) for _ in range(8)]
    src = torch.tensor([17, 18, 19, -1, 900], device=RUN.dev)
    dst = torch.tensor([500, 501, 502, 503, -1], device=RUN.dev)
    ref = [t.clone() for t in caches]
    _ref.copy_slots_ref(ref, src, dst)
    K.copy_slots(caches, src, dst)
    results.append({"op": "copy_slots", "ok": all(torch.equal(a, b) for a, b in zip(caches, ref))})
    table = torch.zeros((65, 4096), dtype=torch.int32, device=RUN.dev)
    counts = torch.randint(0, 300, (48,), generator=gen)
    rows = torch.randperm(64, generator=gen)[:48]
    starts = torch.randint(0, 3000, (48,), generator=gen)
    slots = torch.randint(1, 10**6, (int(counts.sum()),), generator=gen)
    want = table.cpu().clone()
    _ref.write_req_to_token_ref(want, rows, starts, counts, slots)
    K.write_req_to_token(table, rows.to(RUN.dev), starts.to(RUN.dev), counts.to(RUN.dev), slots.to(RUN.dev))
    results.append({"op": "write_req_to_token", "ok": torch.equal(table.cpu(), want)})
    failed = [r for r in results if not all(v for k, v in r.items() if k.endswith("ok"))]
    log(f"[correctness] {len(results) - len(failed)}/{len(results)} cases match the torch reference")
    for r in failed:
        log(f"  MISMATCH {r}")
    return {"cases": results, "all_ok": not failed}


def section_copy_capture(layers: int = 40) -> dict[str, Any]:
    """copy_slots per layer over more cache sets than the old 16-entry table cache held,
    captured in one graph, then 300 more eager sets (which would have evicted the
    tables), then replayed: every layer's rows must be copied correctly."""
    import kvpool.kernels as K

    gen = torch.Generator().manual_seed(1)
    sets = [[torch.randn((32, 16, 2, 64), generator=gen).to(RUN.dev, torch.bfloat16) for _ in range(2)]
            for _ in range(layers)]
    src = torch.tensor([3, 4, 5], device=RUN.dev)
    dst = torch.tensor([300, 301, 302], device=RUN.dev)
    for s in sets:  # warm-up: builds every offsets table outside capture
        K.copy_slots(s, src, dst)
    if RUN.dry:
        return {"skipped": "dry run: no graph capture on cpu"}
    sync()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for s in sets:
            K.copy_slots(s, src, dst)
    others = [[torch.zeros((4, 16, 2, 64), device=RUN.dev, dtype=torch.bfloat16)] for _ in range(300)]
    for o in others:
        K.copy_slots(o, torch.tensor([1], device=RUN.dev), torch.tensor([2], device=RUN.dev))
    del others
    torch.cuda.empty_cache()
    for s in sets:  # scribble over the destinations, then let the replay redo the copies
        for t in s:
            t.reshape(-1, 2, 64)[300:303] = 0
    g.replay()
    sync()
    ok = all(torch.equal(t.reshape(-1, 2, 64)[300:303], t.reshape(-1, 2, 64)[3:6]) for s in sets for t in s)
    log(f"[copy_capture] {layers} per-layer copy_slots replayed after 300 other cache sets: correct {ok}")
    return {"layers": layers, "ok": ok}


def _runner_pool(seed: int):
    import kvpool

    pool = kvpool.KVPool(3, 4, 64, dtype=torch.bfloat16, device=RUN.dev, page_size=16, num_pages=512,
                         max_requests=64, max_context_len=256, layout="paged")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in pool.k_buffers + pool.v_buffers:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return pool


def _lengths(pool, handles) -> np.ndarray:
    return np.asarray(pool.lengths(handles))


def section_runner(toy_decode) -> dict[str, Any]:
    from kvpool.cuda_graph import DecodeGraphRunner

    out: dict[str, Any] = {}
    for mode_name, ctx in (("inference_mode", torch.inference_mode), ("no_grad", torch.no_grad)):
        pool, twin = _runner_pool(1), _runner_pool(1)
        step, twin_step = toy_decode(pool), toy_decode(twin)
        runner = DecodeGraphRunner(pool, step, max_batch_size=32, debug=True)
        t0 = time.perf_counter()
        with ctx():
            runner.capture()
        cap_s = time.perf_counter() - t0
        checks = []
        rng = np.random.default_rng(0)
        for bs in (1, 13) if RUN.dry else (1, 3, 8, 13, 32):  # a dry run: one padded bucket
            hs = [p.open(bs) for p in (pool, twin)]
            lens = rng.integers(1, 120, size=bs)
            for p, h in zip((pool, twin), hs):
                p.extend(h, lens)
            for it in range(1 if RUN.dry else 2):
                res = [p.extend(h, 1) for p, h in zip((pool, twin), hs)]
                ln = _lengths(pool, hs[0])
                ids = rng.integers(0, 64, size=bs)
                args = [(ids, ln - 1, p.rows(h), r.slots, ln) for p, h, r in zip((pool, twin), hs, res)]
                before = [t.clone() for t in pool.k_buffers + pool.v_buffers]
                with ctx():
                    got = runner.run(*args[0])
                    want = twin_step(*(torch.as_tensor(np.asarray(a, dtype=np.int64), device=RUN.dev)
                                       for a in args[1]))
                sync()
                real = set(int(s) for s in res[0].slots)
                keep = torch.ones(pool.num_slots, dtype=torch.bool)
                keep[sorted(real | set(range(pool.page_size)))] = False
                keep = keep.to(RUN.dev)
                untouched = all(torch.equal(t.reshape(-1, 4, 64)[keep], b.reshape(-1, 4, 64)[keep])
                                for t, b in zip(pool.k_buffers + pool.v_buffers, before))
                # Layer 0's K/V are an elementwise function of the inputs: exact check.
                x = step.emb[torch.as_tensor(ids, device=RUN.dev)]
                k0, v0 = step.kv(x, torch.as_tensor(ln - 1, device=RUN.dev), 0)
                sl = torch.as_tensor(res[0].slots, device=RUN.dev)
                exact_l0 = torch.equal(pool.k_buffer(0).reshape(-1, 4, 64)[sl], k0) and \
                    torch.equal(pool.v_buffer(0).reshape(-1, 4, 64)[sl], v0)
                close = torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
                checks.append({"batch": bs, "bucket": runner.bucket_for(bs), "iter": it,
                               "layer0_kv_exact": bool(exact_l0), "others_untouched": bool(untouched),
                               "logits_match_eager": bool(close),
                               "output_is_inference": bool(got.is_inference())})
            for p, h in zip((pool, twin), hs):
                p.close(h)
        ok = all(c["layer0_kv_exact"] and c["others_untouched"] and c["logits_match_eager"]
                 and c["output_is_inference"] == (mode_name == "inference_mode") for c in checks)
        out[mode_name] = {"capture_s": cap_s, "buckets": runner.buckets, "checks": checks, "ok": ok}
        log(f"[runner:{mode_name}] captured {len(runner.captured)} buckets in {cap_s:.1f}s; "
            f"{len(checks)} replays, all correct: {ok}")
    out["bucket_outputs"] = _bucket_outputs(toy_decode)
    return out


def _bucket_outputs(toy_decode) -> dict[str, Any]:
    """The documented contract (valid until the next run() of any bucket) and whether
    this device's graphs really reuse a small bucket's output memory; copy_outputs=True
    must keep outputs across runs."""
    from kvpool.cuda_graph import DecodeGraphRunner

    res: dict[str, Any] = {}
    for copy in (False, True):
        pool = _runner_pool(2)
        runner = DecodeGraphRunner(pool, toy_decode(pool), 16, buckets=[2, 16], copy_outputs=copy)
        with torch.inference_mode():
            runner.capture()
            h = pool.open(1)
            pool.extend(h, 5)
            r = pool.extend(h, 1)
            ln = _lengths(pool, h)
            small = runner.run([3], ln - 1, pool.rows(h), r.slots, ln)
            kept = small.clone()
            h2 = pool.open(12)
            pool.extend(h2, 4)
            r2 = pool.extend(h2, 1)
            ln2 = _lengths(pool, h2)
            runner.run(np.arange(12) % 64, ln2 - 1, pool.rows(h2), r2.slots, ln2)
            sync()
        res["copy_outputs" if copy else "views"] = {"small_output_changed_by_big_run": not torch.equal(small, kept)}
    res["ok"] = not res["copy_outputs"]["small_output_changed_by_big_run"]
    log(f"[runner] bucket outputs: views overwritten by another bucket's run: "
        f"{res['views']['small_output_changed_by_big_run']}; copy_outputs kept: {res['ok']}")
    return res


def section_no_sync(toy_decode) -> dict[str, Any]:
    """'No pool call syncs the device': queue ~100 ms of GPU work, then time each call on
    the host. A call that waits for the stream (a sync, or a pageable H2D copy the driver
    stages after the queued work) takes about as long as the queued work."""
    if RUN.dry:
        return {"skipped": "dry run: needs a CUDA stream"}
    import kvpool
    from kvpool.cuda_graph import DecodeGraphRunner

    pool = kvpool.KVPool(2, 8, 128, dtype=torch.bfloat16, device="cuda", page_size=16, num_pages=2048,
                         max_requests=256, max_context_len=2048)
    runner = DecodeGraphRunner(pool, toy_decode(pool), 64, buckets=[64])
    h = pool.open(64)
    pool.extend(h, 100)
    k = torch.randn((64, 8, 128), device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        runner.capture()
    calls = {
        "extend_decode": lambda: pool.extend(h, 1),
        "extend_prefill": lambda: pool.extend(h, 8),
        "write_device_slots": lambda: pool.write(0, last.out_cache_loc[:64], k, k),
        "write_host_slots": lambda: pool.write(0, last.slots[:64], k, k),
        "page_table": lambda: pool.page_table(h),
        "runner_run_host_inputs": lambda: runner.run(np.zeros(64, dtype=np.int64), _lengths(pool, h) - 1,
                                                     pool.rows(h), last.slots[:64], _lengths(pool, h)),
        # Two steps back to back: the second must not wait for the first one's input copy.
        "runner_run_twice": lambda: [runner.run(np.zeros(64, dtype=np.int64), _lengths(pool, h) - 1,
                                                pool.rows(h), last.slots[:64], _lengths(pool, h)) for _ in range(2)],
    }
    # A hybrid pool's extend (table writes, window nulls, out_cache_loc) stages its host
    # data through its own pinned ring, as the plain pool's does.
    hpool = kvpool.KVPool(4, 8, 128, layer_types=["sliding_attention", "full_attention", "linear_attention",
                                                  "full_attention"], sliding_window=64,
                          state_shapes={"conv": (4, 256)}, dtype=torch.bfloat16, device="cuda", page_size=16,
                          num_pages=2048, max_requests=256, max_context_len=2048)
    hh = hpool.open(64)
    hpool.extend(hh, 100)
    calls["hybrid_extend_decode"] = lambda: hpool.extend(hh, 1)
    last = pool.extend(h, 1)
    # 100 ms of GPU time at ~2 GHz; measured below, not assumed.
    cycles = int(2e8)
    t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t[0].record()
    torch.cuda._sleep(cycles)
    t[1].record()
    t[1].synchronize()
    sleep_ms = t[0].elapsed_time(t[1])
    out: dict[str, Any] = {"queued_gpu_ms": sleep_ms}
    with torch.inference_mode():
        for name, fn in calls.items():
            fn()  # warm
            sync()
            torch.cuda._sleep(cycles)
            t0 = time.perf_counter()
            r = fn()
            host_ms = (time.perf_counter() - t0) * 1e3
            if name.startswith("extend"):
                last = r
            sync()
            out[name] = {"host_ms": host_ms, "waited_for_gpu": host_ms > 0.5 * sleep_ms}
    out["ok"] = not any(v["waited_for_gpu"] for v in out.values() if isinstance(v, dict))
    log(f"[no_sync] host ms with {sleep_ms:.0f} ms queued on the GPU: "
        + ", ".join(f"{k} {v['host_ms']:.2f}" for k, v in out.items() if isinstance(v, dict)))
    return out


def section_shared_pages() -> dict[str, Any]:
    """OPTIONAL (runs once KVPool has fork / open_with_prefix): copy-on-write copies and
    prefix-attached req_to_token rows on the device."""
    import kvpool

    pool = kvpool.KVPool(2, 4, 64, dtype=torch.bfloat16, device=RUN.dev, page_size=16, num_pages=256,
                         max_requests=32, max_context_len=512)
    if not (hasattr(pool, "fork") and hasattr(pool, "open_with_prefix")):
        log("[shared_pages] skipped: this KVPool has no fork/open_with_prefix yet")
        return {"skipped": "KVPool has no fork/open_with_prefix (shared pages not landed)"}
    if RUN.dry:
        # Without its host-table shortcut a CPU pool takes the CUDA code path (packed
        # extend, the table kernel, copy_slots for copy-on-write) with the torch kernels.
        pool._table_np = None
    gen = torch.Generator().manual_seed(4)

    def row_slots(h, n):
        return pool.req_to_token[int(pool.rows(h)[0]), :n].long()

    def fill(h, slots):
        for layer in range(pool.num_layers):
            k = torch.randn((len(slots), 4, 64), generator=gen).to(RUN.dev, torch.bfloat16)
            pool.write(layer, slots, k, k + 1)

    def kv(slots):
        return [pool.read(layer, slots) for layer in range(pool.num_layers)]

    prompt = np.arange(1000, 1000 + 70, dtype=np.int64)  # 4 full pages + 6 tokens
    a = pool.open(1)
    ra = pool.extend(a, [len(prompt)], tokens=prompt)
    fill(a, ra.out_cache_loc)
    pool.cache(a)
    sync()
    b, cached = pool.open_with_prefix(np.concatenate([prompt[:64], [7, 8, 9]]), [67])
    hit = int(np.asarray(cached)[0])
    pool.extend(b, [67 - hit], tokens=np.asarray([7, 8, 9], dtype=np.int64)[-(67 - hit):])
    prefix_ok = hit == 64 and torch.equal(row_slots(b, hit).cpu(), row_slots(a, hit).cpu())
    # Fork a's partial last page, then extend the child: copy-on-write of 6 valid rows.
    parent_kv = kv(row_slots(a, 70))
    c = np.asarray(pool.fork(int(a[0]), 1))  # fork takes one parent handle
    rc = pool.extend(c, [1], tokens=np.asarray([5], dtype=np.int64))
    fill(c, rc.out_cache_loc)
    sync()
    c_slots = row_slots(c, 71)
    a_slots = row_slots(a, 70)
    moved = not torch.equal(c_slots[64:70].cpu(), a_slots[64:70].cpu())
    child_kv = kv(c_slots[:70])
    cow_ok = moved and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                           for x, y in zip(child_kv, parent_kv))
    parent_ok = all(torch.equal(x[0], y[0]) for x, y in zip(kv(a_slots), parent_kv))
    if hasattr(pool, "check"):
        pool.check()
    ok = prefix_ok and cow_ok and parent_ok
    log(f"[shared_pages] prefix rows attached: {prefix_ok} (hit {hit}); copy-on-write copied: {cow_ok}; "
        f"parent intact: {parent_ok}")
    return {"prefix_hit_tokens": hit, "prefix_rows_ok": prefix_ok, "cow_ok": cow_ok,
            "parent_untouched": parent_ok, "ok": ok}
