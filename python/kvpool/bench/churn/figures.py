"""The churn targets: baselines against kvpool at the reference point, and kvpool across pool sizes."""

from __future__ import annotations

from typing import Any

from kvpool.bench.churn.result import ChurnResult
from kvpool.bench.columns import size
from kvpool.bench.report import against_kvpool, or_none, ratio_line, time_ratios

SCALING_TARGET = 1.10  # kvpool per-step time, largest pool / smallest pool
SPEEDUP_TARGET = 10.0  # baseline per-step time / kvpool's at the reference point


def churn_ratios(results: list[ChurnResult], ref_pool: int, ref_conc: int) -> dict[str, Any]:
    """Each baseline's per-step time over kvpool's at (ref_pool, ref_conc), and kvpool's pool scaling."""
    speed: dict[str, Any] = {}
    for r, kv in against_kvpool(results):
        if (r.num_slots, r.concurrency) == (ref_pool, ref_conc):
            speed[f"{r.allocator} page {r.page_size}"] = {
                **time_ratios(r, kv, 2), "meets_target": r.mean_us / kv.mean_us >= SPEEDUP_TARGET}
    scaling: dict[str, Any] = {}
    for ps in sorted({r.page_size for r in results}):
        kvs = sorted((r for r in results if r.allocator == "kvpool" and r.page_size == ps
                      and r.concurrency == ref_conc), key=lambda r: r.num_slots)
        if len(kvs) >= 2:
            lo, hi = kvs[0], kvs[-1]
            scaling[f"page {ps} {size(hi.num_slots)}/{size(lo.num_slots)}"] = {
                **time_ratios(hi, lo, 3), "meets_target": hi.mean_us / lo.mean_us <= SCALING_TARGET}
    return {"ref_pool": ref_pool, "ref_concurrency": ref_conc, "baseline_over_kvpool": speed,
            "kvpool_scaling": scaling, "speedup_target": SPEEDUP_TARGET, "scaling_target": SCALING_TARGET}


def ratio_lines(ratios: dict[str, Any]) -> str:
    if not ratios:
        return ""
    at = f"pool {size(ratios['ref_pool'])}, concurrency {ratios['ref_concurrency']}"
    lines = [f"\nBaseline µs/step ÷ kvpool µs/step at {at} (target >= {SPEEDUP_TARGET:g}x):"]
    lines += or_none([ratio_line(name, v, "7.1f") for name, v in ratios["baseline_over_kvpool"].items()])
    lines.append(f"kvpool µs/step, largest pool ÷ smallest (target <= {SCALING_TARGET:g}):")
    lines += [ratio_line(name, v, "7.3f", unit=" ") for name, v in ratios["kvpool_scaling"].items()]
    return "\n".join(lines)


__all__ = ["SCALING_TARGET", "SPEEDUP_TARGET", "churn_ratios", "ratio_lines"]
