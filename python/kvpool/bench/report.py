"""Tables (markdown, so the same text reads in a terminal and in benchmarks/results/README.md), ratios, JSON."""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from typing import Any, Optional

from kvpool.bench.runner import ChurnResult

SCALING_TARGET = 1.10  # kvpool per-step time, largest pool / smallest pool
SPEEDUP_TARGET = 10.0  # baseline per-step time / kvpool's at the reference point


def size(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def _md(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _key(r: ChurnResult) -> tuple[int, int, int]:
    return (r.page_size, r.num_slots, r.concurrency)


def churn_table(results: list[ChurnResult]) -> str:
    kv = {_key(r): r for r in results if r.allocator == "kvpool"}
    rows = []
    for r in results:
        base = kv.get(_key(r))
        x = xc = ""
        if base is not None and r is not base:
            x = f"{r.mean_us / base.mean_us:.1f}x" if base.mean_us else ""
            xc = f"{r.cpu_mean_us / base.cpu_mean_us:.1f}x" if base.cpu_mean_us else ""
        rows.append([
            str(r.page_size), size(r.num_slots), str(r.concurrency), f"{r.mean_batch:.0f}", r.allocator,
            f"{r.mean_us:.1f}", f"{r.p50_us:.1f}", f"{r.p99_us:.1f}", f"{r.cpu_mean_us:.1f}",
            f"{r.ns_per_slot:.1f}", f"{r.meta_bytes / 2**20:.1f}", x, xc,
        ])
    header = ["page", "pool", "conc", "batch", "allocator", "µs/step mean", "p50", "p99", "cpu µs mean",
              "ns/slot", "meta MiB", "÷ kvpool", "÷ kvpool (cpu)"]
    return _md(header, rows)


def churn_ratios(results: list[ChurnResult], ref_pool: int, ref_conc: int) -> dict[str, Any]:
    """Each baseline's per-step time over kvpool's at (ref_pool, ref_conc), and kvpool's pool scaling."""
    by = {(_key(r), r.allocator): r for r in results}
    out: dict[str, Any] = {"ref_pool": ref_pool, "ref_concurrency": ref_conc, "baseline_over_kvpool": {},
                           "kvpool_scaling": {}, "speedup_target": SPEEDUP_TARGET,
                           "scaling_target": SCALING_TARGET}
    for (key, name), r in by.items():
        ps, pool, conc = key
        kv = by.get((key, "kvpool"))
        if name == "kvpool" or kv is None or (pool, conc) != (ref_pool, ref_conc):
            continue
        mean, p50, cpu = r.mean_us / kv.mean_us, r.p50_us / kv.p50_us, r.cpu_mean_us / kv.cpu_mean_us
        out["baseline_over_kvpool"][f"{name} page {ps}"] = {
            "mean": round(mean, 2), "p50": round(p50, 2), "cpu_mean": round(cpu, 2),
            "meets_target": mean >= SPEEDUP_TARGET}
    for ps in sorted({r.page_size for r in results}):
        kvs = sorted((r for r in results if r.allocator == "kvpool" and r.page_size == ps
                      and r.concurrency == ref_conc), key=lambda r: r.num_slots)
        if len(kvs) >= 2:
            lo, hi = kvs[0], kvs[-1]
            mean, p50, cpu = hi.mean_us / lo.mean_us, hi.p50_us / lo.p50_us, hi.cpu_mean_us / lo.cpu_mean_us
            out["kvpool_scaling"][f"page {ps} {size(hi.num_slots)}/{size(lo.num_slots)}"] = {
                "mean": round(mean, 3), "p50": round(p50, 3), "cpu_mean": round(cpu, 3),
                "meets_target": mean <= SCALING_TARGET}
    return out


def ratio_lines(ratios: dict[str, Any]) -> str:
    if not ratios:
        return ""
    at = f"pool {size(ratios['ref_pool'])}, concurrency {ratios['ref_concurrency']}"
    lines = [f"\nBaseline µs/step ÷ kvpool µs/step at {at} (target >= {SPEEDUP_TARGET:g}x):"]
    for name, v in ratios["baseline_over_kvpool"].items():
        ok = "meets" if v["meets_target"] else "MISSES"
        lines.append(f"  {name:28s} mean {v['mean']:7.1f}x   p50 {v['p50']:7.1f}x   "
                     f"cpu mean {v['cpu_mean']:7.1f}x   {ok} target")
    lines.append(f"kvpool µs/step, largest pool ÷ smallest (target <= {SCALING_TARGET:g}):")
    for name, v in ratios["kvpool_scaling"].items():
        ok = "meets" if v["meets_target"] else "MISSES"
        lines.append(f"  {name:28s} mean {v['mean']:7.3f}    p50 {v['p50']:7.3f}    "
                     f"cpu mean {v['cpu_mean']:7.3f}    {ok} target")
    return "\n".join(lines)


def ops_table(rows: list[dict[str, Any]]) -> str:
    header = ["op", "page", "batch", "µs mean", "p50", "p99", "ns/item"]
    body = [[r["op"], str(r["page_size"]), str(r["batch"]), f"{r['mean_us']:.2f}", f"{r['p50_us']:.2f}",
             f"{r['p99_us']:.2f}", f"{r['ns_per_item']:.1f}"] for r in rows]
    return _md(header, body)


def add_out_argument(p: Any) -> None:
    """``--out DIR``: where a benchmark writes its files (never a path inside the package)."""
    p.add_argument("--out", default=".", metavar="DIR",
                   help="directory for the JSON / PNG outputs (default: the current directory; created "
                        "if missing); absolute --json / --plot paths are used as given")


def output_path(out_dir: str, name: str) -> str:
    """``name`` under ``out_dir`` (an absolute ``name`` stays as it is); its folder is created."""
    path = os.path.join(out_dir, name)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def write_json(path: str, doc: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    import torch

    versions: dict[str, Optional[str]] = {}
    for pkg in ("kvpool", "numpy", "torch", "sglang", "vllm"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "os": platform.platform(), "torch_threads": torch.get_num_threads(), "versions": versions,
            "git_commit": _git_commit()}


def _git_commit() -> Optional[str]:
    """The checkout's commit when run from one (which kvpool the figures belong to)."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
