"""The host_tier section of benchmarks/gpu_check.py: whole-page offload (device -> pinned
host) and load (host -> device) bandwidth of kvpool.kernels.offload_pages / load_pages,
both methods (the Triton kernel through the pinned buffer's device-mapped address, and
the batched cudaMemcpyAsync of a device-side gather), against one plain pinned
cudaMemcpyAsync of the same bytes; plus a bitwise check of both methods and the host
time of TransferRunner.run while the caller's stream is busy (it must not wait); and the
wired pool (KVPool with host pages): an offload -> evict -> load round trip and a swap
round trip, bitwise, with the swap's bandwidth through the pool.

Shapes: a Llama-8B-like page (32 layers, 8 KV heads x 128, bf16, page 16: 2 MiB) and a
small one (8 layers, 4 x 64, bf16, page 4: 64 KiB), random page ids on both sides."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gpu_common import RUN, log, sync

# name: (layers, kv heads, head_dim, page size, pages per call)
SHAPES = {"llama8b_2MiB": (32, 8, 128, 16, 64), "small_64KiB": (8, 4, 64, 4, 512)}
DRY_SHAPES = {"llama8b_2MiB": (2, 2, 8, 4, 3), "small_64KiB": (2, 1, 8, 1, 5)}
TARGET_PCT = 80.0


def _time_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median device milliseconds of fn() (CUDA events; wall time in a dry run)."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        if RUN.dry:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8).cpu()


def _shape(name: str, layers: int, heads: int, dim: int, page: int, n: int, reps: int) -> dict[str, Any]:
    from kvpool.kernels import PageTransfer
    from kvpool.tiers import HostStorage

    dt = torch.bfloat16
    dev_pages = 2 * n + 1
    caches = [torch.randn((layers, dev_pages * page, heads, dim), device=RUN.dev).to(dt) for _ in range(2)]
    # Twice the host pages needed, ids drawn at random: few consecutive runs, as in a
    # host tier that has been evicting for a while.
    host = HostStorage(2 * n + 1, num_layers=layers, page_size=page, heads=heads, head_dim=dim, dtype=dt,
                       device=RUN.dev)
    rng = np.random.default_rng(0)
    src = rng.permutation(np.arange(1, dev_pages))[:n]
    hst = rng.permutation(np.arange(1, 2 * n + 1))[:n]
    dst = np.setdiff1d(np.arange(1, dev_pages), src)[:n]
    nbytes = n * host.page_bytes
    # The reference: one copy of the same bytes between contiguous device and pinned memory.
    dev_flat = torch.empty(nbytes, dtype=torch.uint8, device=RUN.dev)
    host_flat = host.buffer.view(-1).view(torch.uint8)[host.page_bytes : host.page_bytes + nbytes]
    out: dict[str, Any] = {"page_bytes": host.page_bytes, "pages_per_call": n, "bytes_per_call": nbytes,
                           "layers": layers, "heads": heads, "head_dim": dim, "page_size": page,
                           "pinned": host.pin_method}
    ok = True
    for direction in ("offload", "load"):
        entry: dict[str, Any] = {}
        if direction == "offload":
            ref = _time_ms(lambda: host_flat.copy_(dev_flat, non_blocking=True), reps)
        else:
            ref = _time_ms(lambda: dev_flat.copy_(host_flat, non_blocking=True), reps)
        entry["memcpy"] = {"ms": ref, "GBps": nbytes / ref / 1e6}
        for method in ("kernel", "copy"):
            if direction == "offload":
                t = PageTransfer.offload(caches, host, src, hst, method=method)
            else:
                t = PageTransfer.load(host, caches, hst, dst, method=method)
            ms = _time_ms(t.run, reps)
            entry[method] = {"ms": ms, "GBps": nbytes / ms / 1e6, "pct_of_memcpy": 100.0 * ref / ms}
            # Host cost of one whole call (validate, stage the ids, launch), GPU idle or not.
            t0 = time.perf_counter()
            if direction == "offload":
                PageTransfer.offload(caches, host, src, hst, method=method).run()
            else:
                PageTransfer.load(host, caches, hst, dst, method=method).run()
            entry[method]["host_us_per_call"] = (time.perf_counter() - t0) * 1e6
            sync()
        out[direction] = entry
        log(f"[host_tier] {name} {direction} {n} x {host.page_bytes >> 10} KiB: memcpy {entry['memcpy']['GBps']:.1f} "
            f"GB/s, kernel {entry['kernel']['GBps']:.1f} ({entry['kernel']['pct_of_memcpy']:.0f}%), copy "
            f"{entry['copy']['GBps']:.1f} ({entry['copy']['pct_of_memcpy']:.0f}%)")
    # Bitwise: both methods, device pages -> host -> other device pages.
    for method in ("kernel", "copy"):
        for c in caches:
            c[:, dst[0] * page : (dst[0] + 1) * page].zero_()
        PageTransfer.offload(caches, host, src[:2], [1, 2], method=method).run()
        PageTransfer.load(host, caches, [1, 2], dst[:2], method=method).run()
        sync()
        for c in caches:
            for s, d in zip(src[:2], dst[:2]):
                same = torch.equal(_bits(c[:, s * page : (s + 1) * page]), _bits(c[:, d * page : (d + 1) * page]))
                ok = ok and same
    out["bitwise_ok"] = ok
    return out


def _no_sync() -> dict[str, Any]:
    """TransferRunner.run's host time while 100 ms of work is queued on the caller's stream."""
    from kvpool.tiers import HostStorage, TransferRunner

    caches = [torch.zeros((4, 64 * 16, 8, 128), dtype=torch.bfloat16, device=RUN.dev) for _ in range(2)]
    host = HostStorage(16, num_layers=4, page_size=16, heads=8, head_dim=128, dtype=torch.bfloat16, device=RUN.dev)
    runner = TransferRunner(caches, host, RUN.dev)

    def one() -> None:
        runner.run(offloads=(np.array([2, 3]), np.array([2, 3])), loads=(np.array([4, 7]), np.array([5, 9])),
                   copies=(np.arange(16, 32), np.arange(16 * 6, 16 * 7)))

    one()  # the same specializations as the timed call: nothing compiles while timing
    sync()
    if not RUN.dry:
        torch.cuda._sleep(200_000_000)  # ~100 ms on current GPUs
    t0 = time.perf_counter()
    one()
    host_ms = (time.perf_counter() - t0) * 1e3
    sync()
    if RUN.dry:  # a CPU pool does the work inside run(): nothing to wait for, nothing to judge
        return {"run_host_ms_with_busy_stream": host_ms, "ok": True, "note": "dry run: no stream"}
    return {"run_host_ms_with_busy_stream": host_ms, "ok": host_ms < 50.0}


def _pool_round_trip(dry: bool) -> dict[str, Any]:
    """The wired pool: KVPool(host_pages=...) on the device. A cached prefix evicted by
    pressure (write_back offload) and hit again from the host (load), and a request
    swapped out and in, both bitwise; then swap_out / swap_in of a large request timed
    through the pool (its transfers on the copy stream, the caller's stream waiting)."""
    import kvpool

    layers, heads, dim, page, pages = (2, 2, 8, 4, 6) if dry else (32, 8, 128, 16, 256)
    pool = kvpool.KVPool(layers, heads, dim, dtype=torch.bfloat16, device=RUN.dev, page_size=page,
                         num_pages=2 * pages + 2, max_requests=4, max_context_len=3 * pages * page,
                         host_pages=3 * pages + 1)
    gen = torch.Generator(device=RUN.dev).manual_seed(0)

    def fill(h: int, start: int) -> None:
        slots = torch.as_tensor(pool.slots(h)[start:], device=RUN.dev)
        for layer in range(layers):
            kv = torch.randn((len(slots), heads, dim), generator=gen, device=RUN.dev, dtype=torch.bfloat16)
            pool.write(layer, slots, kv, -kv)

    def raw(h: int, n: int) -> torch.Tensor:
        idx = torch.as_tensor(pool.slots(h)[:n], device=RUN.dev)
        return torch.cat([c[:, idx].reshape(-1).view(torch.uint8) for c in pool._storage.caches]).cpu()

    prompt = list(range(1000, 1000 + pages * page + 1))
    h, _ = pool.open_with_prefix(prompt, [len(prompt)])
    pool.extend(h, len(prompt))
    fill(int(h[0]), 0)
    want = raw(int(h[0]), pages * page)
    pool.close(h, cache=True)
    other = list(range(90000, 90000 + pool.free_pages * page - 1))  # takes every device page
    h2, _ = pool.open_with_prefix(other, [len(other)])
    pool.extend(h2, len(other))
    fill(int(h2[0]), 0)
    pool.close(h2)
    h3, cached = pool.open_with_prefix(prompt, [len(prompt)])
    sync()
    hit_ok = int(cached[0]) == pages * page and pool.host_hit_tokens == pages * page and torch.equal(
        raw(int(h3[0]), pages * page), want)
    pool.extend(h3, 1)
    fill(int(h3[0]), pages * page)
    before = raw(int(h3[0]), pages * page + 1)
    bytes_moved = pages * pool.host.page_bytes
    timings: dict[str, float] = {}
    for name, call in (("swap_out", pool.swap_out), ("swap_in", pool.swap_in)):
        sync()
        t0 = time.perf_counter()
        call(h3)
        host_ms = (time.perf_counter() - t0) * 1e3
        sync()
        timings[f"{name}_host_ms"] = host_ms
        timings[f"{name}_wall_ms"] = (time.perf_counter() - t0) * 1e3
    swap_ok = torch.equal(raw(int(h3[0]), pages * page + 1), before)
    pool.close(h3)
    pool.check()
    out = {"pages": pages, "page_bytes": pool.host.page_bytes, "hit_bitwise_ok": bool(hit_ok),
           "swap_bitwise_ok": bool(swap_ok), **timings,
           "offload_bytes": pool.offload_bytes, "load_bytes": pool.load_bytes}
    if not dry:  # wall time of a whole swap (host call + the transfers it queued) as bandwidth
        out["swap_out_GBps"] = bytes_moved / timings["swap_out_wall_ms"] / 1e6
        out["swap_in_GBps"] = bytes_moved / timings["swap_in_wall_ms"] / 1e6
    out["ok"] = bool(hit_ok and swap_ok)
    log(f"[host_tier] pool round trips: hit {'ok' if hit_ok else 'WRONG'}, swap {'ok' if swap_ok else 'WRONG'}")
    return out


def section_host_tier() -> dict[str, Any]:
    shapes = DRY_SHAPES if RUN.dry else SHAPES
    reps = 2 if RUN.dry else 7
    out: dict[str, Any] = {"shapes": {}, "target_pct_of_memcpy": TARGET_PCT}
    for name, (layers, heads, dim, page, n) in shapes.items():
        out["shapes"][name] = _shape(name, layers, heads, dim, page, n, reps)
    out["no_sync"] = _no_sync()
    out["pool"] = _pool_round_trip(RUN.dry)
    pcts = {f"{name}:{d}:{m}": s[d][m]["pct_of_memcpy"] for name, s in out["shapes"].items()
            for d in ("offload", "load") for m in ("kernel", "copy")}
    out["pct_of_memcpy"] = pcts
    for m in ("kernel", "copy"):
        out[f"{m}_min_pct_of_memcpy"] = min(v for k, v in pcts.items() if k.endswith(":" + m))
    out["ok"] = all(s["bitwise_ok"] for s in out["shapes"].values()) and out["no_sync"]["ok"] and out["pool"]["ok"]
    return out
