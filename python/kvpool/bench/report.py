"""What every workload prints and writes: the markdown table, the ratio lines, the JSON file, the plot.

Tables are markdown, so the same text reads in a terminal and in
benchmarks/results/README.md. A workload supplies its columns, ratios and plot
panels (``workload.py``); everything else here is the same for all of them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from collections.abc import Iterator
from importlib import metadata
from typing import TYPE_CHECKING, Any, TypeVar

from kvpool.bench.cli import add_out_argument, settings
from kvpool.bench.columns import Column
from kvpool.bench.result import Result

if TYPE_CHECKING:
    from kvpool.bench.workload import Workload

R = TypeVar("R", bound=Result)


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def table(results: list[Result], columns: list[Column], versus_kvpool: list[tuple[str, str]]) -> str:
    """One row per result; each ``versus_kvpool`` (header, field) column divides the row's field by
    kvpool's on the same trace (blank on kvpool's own rows)."""
    kv = {r.case: r for r in results if r.allocator == "kvpool"}
    rows = []
    for r in results:
        base = kv.get(r.case)
        ratios = [_times(getattr(r, f) / getattr(base, f)) if base is not None and r is not base and getattr(base, f)
                  else "" for _, f in versus_kvpool]
        rows.append([cell(r) for _, cell in columns] + ratios)
    return md_table([h for h, _ in columns] + [h for h, _ in versus_kvpool], rows)


def _times(x: float) -> str:
    """A ratio for the table: one decimal from 1x up, two significant digits below (a row 50 times
    faster than kvpool's printed '0.0x')."""
    return f"{x:.1f}x" if x >= 1 else f"{x:.2g}x"


def against_kvpool(results: list[R]) -> Iterator[tuple[R, R]]:
    """(row, kvpool's row on the same trace) for every other allocator's row that has one."""
    kv = {r.case: r for r in results if r.allocator == "kvpool"}
    for r in results:
        base = kv.get(r.case)
        if r.allocator != "kvpool" and base is not None:
            yield r, base


def time_ratios(num: Result, den: Result, digits: int) -> dict[str, float]:
    """``num``'s step times over ``den``'s: wall mean, median and thread-CPU mean."""
    return {"mean": round(num.mean_us / den.mean_us, digits), "p50": round(num.p50_us / den.p50_us, digits),
            "cpu_mean": round(num.cpu_mean_us / den.cpu_mean_us, digits)}


NO_BASELINE = "  (none: no baseline ran on these traces; see the 'skipping' lines and --allocators)"


def or_none(lines: list[str]) -> list[str]:
    """A ratio block's lines, or one line saying why it has none: a header over nothing read as if the
    figures had been cut off."""
    return lines or [NO_BASELINE]


def ratio_line(name: str, v: dict[str, Any], spec: str, unit: str = "x", extra: str = "") -> str:
    """One line of a ratio block: the three time ratios of ``v`` and whether it meets its target."""
    ok = "meets" if v["meets_target"] else "MISSES"
    return (f"  {name:34s} mean {v['mean']:{spec}}{unit}   p50 {v['p50']:{spec}}{unit}   "
            f"cpu mean {v['cpu_mean']:{spec}}{unit}   {extra}{ok} target")


def output_path(out_dir: str, name: str) -> str:
    """``name`` under ``out_dir`` (an absolute ``name`` stays as it is); its folder is created."""
    path = os.path.join(out_dir, name)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def _finite(x: Any) -> Any:
    """``x`` with every NaN or infinite float as None: strict JSON has no NaN or Infinity, and a
    ratio over a zero (no request fit, no hit) is undefined, which null says."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` as strict JSON; the file appears whole or not at all (a run that fails while
    writing leaves no half file, and an earlier file of that name stays as it was)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(_finite(doc), f, indent=1, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def publish(workload: Workload, args: argparse.Namespace, machine: dict[str, Any], results: list[Result],
            skipped: list[str]) -> int:
    """Print the table, ratios and notes, write the JSON and the plot; 1 if a replay ended inconsistent."""
    ratios = workload.ratios(results, args)
    print(table(results, workload.columns, workload.versus_kvpool))
    print(workload.ratio_lines(ratios))
    for note in workload.notes(machine):
        print(note)
    if args.quick:
        print("(quick run: a tiny pool and few steps, a smoke test; the targets are for the full run)")
    bad = [r for r in results if not r.consistent]
    for r in bad:
        print(f"INCONSISTENT {r.allocator} {r.case_label}: {r.inconsistency()}", file=sys.stderr)
    doc = {"benchmark": workload.name, "settings": settings(args), "machine": machine, "skipped": skipped,
           "ratios": ratios, "results": [r.to_json() for r in results]}
    if args.json:
        path = output_path(args.out, args.json)
        write_json(path, doc)
        print(f"wrote {path}")
    if args.plot:
        try:
            from kvpool.bench import plot

            path = output_path(args.out, args.plot)
            plot.figure(results, path, workload.panels(args), workload.plot_title, workload.plot_inches)
            print(f"wrote {path}")
        except ImportError as exc:
            print(f"no plot: {exc} (plots need matplotlib: pip install 'kvpool[bench]')", file=sys.stderr)
    return 1 if bad else 0


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

    versions: dict[str, str | None] = {}
    for pkg in ("kvpool", "numpy", "torch", "sglang", "vllm"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "os": platform.platform(), "torch_threads": torch.get_num_threads(), "versions": versions,
            "git_commit": _git_commit(), "git_dirty": _git_dirty()}


def _git_commit(cwd: str | None = None) -> str | None:
    """The checkout's commit when run from one (which kvpool the figures belong to); ``cwd``: a
    folder in the checkout (default: this package's)."""
    out = _git(["rev-parse", "--short", "HEAD"], cwd)
    return out.strip() or None if out is not None else None


def _git_dirty(cwd: str | None = None) -> bool | None:
    """Whether tracked files of the checkout differ from its commit (None outside one): the
    figures of such a run are not the commit's, though ``git_commit`` names it."""
    out = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
    return None if out is None else bool(out.strip())


def _git(argv: list[str], cwd: str | None) -> str | None:
    import subprocess

    try:
        out = subprocess.run(["git", *argv], capture_output=True, text=True, timeout=5,
                             cwd=cwd or os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


__all__ = ["NO_BASELINE", "add_out_argument", "against_kvpool", "machine_info", "md_table", "or_none", "output_path", "publish", "ratio_line",
           "table", "time_ratios", "write_json"]
