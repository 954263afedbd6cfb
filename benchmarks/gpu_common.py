"""Shared state and timing helpers of benchmarks/gpu_check.py (see its docstring)."""

from __future__ import annotations

import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any


class Run:
    """Where the check runs. dev="cpu" is a dry run of the logic (figures meaningless)."""

    dev = "cuda"
    dry = False
    profile = 0  # gpu_host --profile: functions to report from a cProfile of the extends


RUN = Run()


def log(msg: str) -> None:
    print(msg, flush=True)


def sync() -> None:
    if RUN.dev == "cuda":
        import torch

        torch.cuda.synchronize()


def bench(fn: Callable[[int], Any], inner: int = 50, reps: int = 7) -> dict[str, Any]:
    """Median microseconds per fn(i) call: `inner` calls captured in one CUDA graph
    (launch overhead as in a captured decode step), falling back to eager launches."""
    import torch

    for i in range(1 if RUN.dry else min(inner, 8)):  # compile every specialization before capturing
        fn(i)
    if RUN.dry:
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


_ACCESS = re.compile(r"\b((?:ld|st)\.global(?:\.[a-z0-9]+)*)\b")


def ptx_accesses(jit_fn: Any) -> list[dict[str, Any]]:
    """Global load/store opcodes of every variant of a Triton kernel compiled in this
    process (from the JIT's in-memory cache; compiles nothing)."""
    out: list[dict[str, Any]] = []
    for caches in getattr(jit_fn, "device_caches", {}).values():
        kernels = caches[0] if isinstance(caches, tuple) else {}
        for kernel in list(kernels.values()):
            asm = getattr(kernel, "asm", {})
            ptx = asm.get("ptx") if isinstance(asm, dict) else None
            if isinstance(ptx, bytes):
                ptx = ptx.decode()
            if not ptx:
                continue
            meta = getattr(kernel, "metadata", None)
            out.append({
                "accesses": dict(Counter(_ACCESS.findall(ptx))),
                "num_warps": getattr(meta, "num_warps", None),
            })
    return out
