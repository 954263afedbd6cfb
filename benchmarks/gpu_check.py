"""One-shot GPU check of kvpool's kernels and DecodeGraphRunner, for a bare GPU box.

The box has no network, no Rust and no maturin, so nothing is installed there: the
checkout runs in place with a `_core` extension built beforehand (abi3, so one build
serves every CPython >= 3.9). Needs torch >= 2.4 with Triton and numpy on the box.

    bash benchmarks/build_core.sh                      # here: python/kvpool/_core.abi3.so
    PYTHONPATH=python python benchmarks/gpu_check.py   # there, from the checkout root

(carry python/kvpool/_core.abi3.so to the box: *.so is git-ignored). Under five
minutes with a cold Triton cache on an H200; a --budget-s guard skips whatever
sections would start after the budget; exits 1 when a section raised (named in the
summary's "errors"). Writes JSON to --out, else
$OUT/gpu_check.json when $OUT is set, else ./gpu_check.json (rewritten after every
section, so a crash keeps what ran), and prints every figure. Sections (each
isolated: an error is recorded and the next section runs):
  correctness    kernels on CUDA vs the torch reference (dtypes, layouts, padding,
                 a non-power-of-two float scale)
  runner         capture + replay of a small decode step through KVPool at several
                 batch sizes incl. padded ones, under inference_mode and no_grad: K/V in
                 exactly the right slots, nothing else touched but page 0; outputs of
                 one bucket vs another bucket's run (copy_outputs)
  no_sync        host time of extend (plain and hybrid pool) / write / page_table /
                 runner.run with 100 ms of work queued on the GPU: none may wait for it
  bandwidth      store_kv vs torch index_copy_ / indexed assignment, decode 1..256 and
                 prefill 4k..32k tokens, GB/s and % of peak (target: prefill >= 80%)
  layer_store    per-layer store time inside a captured 32-layer graph (target <= 2 us)
  replay         a captured decode step vs the same step run eagerly (target: faster)
  copy_capture   per-layer copy_slots over 40 cache sets, captured, replayed later
  shared_pages   OPTIONAL: copy-on-write copies and prefix-attached req_to_token rows;
                 runs when KVPool has fork/open_with_prefix, else recorded as skipped
  ptx            global access opcodes of every kernel variant compiled in this run
  copy_reference the device's own copy bandwidth (what "peak" means in practice)
  host_tier      whole-page offload / load bandwidth (offload_pages / load_pages: the Triton
                 kernel and the batched-copy method) vs one pinned cudaMemcpyAsync of the
                 same bytes, 2 MiB and 64 KiB pages; bitwise check; TransferRunner.run must
                 not wait for a busy stream (target: >= 80% of memcpy)
  nccl_transfer  kvpool.distributed.send_request/recv_request between two GPUs over NCCL, GB/s
                 and ms per request vs prompt length (NEEDS >= 2 GPUs; else skipped)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_common import RUN, log, sync

PEAKS_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10": 600.0}
BUILD_HINT = ("build it on a machine with Rust (bash benchmarks/build_core.sh), carry "
              "python/kvpool/_core.abi3.so here, and run from the checkout root with PYTHONPATH=python")


def _preflight() -> dict[str, Any]:
    """Versions, and whether kvpool (with its compiled _core) imports at all."""
    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__}
    try:
        import numpy

        info["numpy"] = numpy.__version__
        import triton

        info["triton"] = triton.__version__
        import kvpool

        info["kvpool"] = getattr(kvpool, "__version__", "?")
        info["kvpool_path"] = str(Path(kvpool.__file__).parent)
        import kvpool._core as core

        info["core"] = Path(core.__file__).name
    except ImportError as e:
        info["error"] = f"{type(e).__name__}: {e}. {BUILD_HINT}"
    return info


def _toy_decode():
    from kvpool.testing.toy_step import ToyDecode

    return ToyDecode


SECTIONS = ["correctness", "runner", "no_sync", "bandwidth", "layer_store", "replay", "copy_capture",
            "shared_pages", "ptx", "copy_reference", "host_tier", "nccl_transfer"]


def _positive(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give one > 0") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{x:g} must be > 0")
    return x


def _sections(text: str) -> set:
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = sorted(names - set(SECTIONS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown section(s) {','.join(unknown) or repr(text)}; choose from "
                                         f"{','.join(SECTIONS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_check.json or ./gpu_check.json)")
    ap.add_argument("--peak-gbps", type=_positive, default=None, help="device peak memory bandwidth, GB/s")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu = dry run of the logic with tiny sizes (no timings worth reading)")
    ap.add_argument("--budget-s", type=_positive, default=240.0,
                    help="start no new section after this many seconds (default 240)")
    ap.add_argument("--only", type=_sections, default=None,
                    help=f"comma-separated section names to run, of {','.join(SECTIONS)}")
    args = ap.parse_args(argv)
    out_path = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    if out_path.is_dir() or (args.out or "").endswith(os.sep):
        ap.error(f"--out {out_path} is a directory; give the JSON file's path")
    try:  # the JSON is saved after every section: a path that cannot be written must fail now, not then
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_path.parent):
            pass
    except OSError as e:
        ap.error(f"--out {out_path}: cannot write it ({e.strerror}); give a writable path")
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    RUN.dev, RUN.dry = args.device, args.device == "cpu"

    def save() -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        # Strict JSON (a figure over nothing is null) written whole: the caller may read it at any time.
        tmp = out_path.with_name(f".{out_path.name}.tmp")
        tmp.write_text(json.dumps(_finite(report), indent=2, default=str, allow_nan=False))
        tmp.replace(out_path)

    report["versions"] = pre = _preflight()
    if "error" in pre:
        log(f"cannot import kvpool: {pre['error']}")
        save()
        return 2
    if RUN.dry:
        log("DRY RUN on cpu: checks the script's logic only; figures are meaningless")
    elif not torch.cuda.is_available():
        report["error"] = "no CUDA device"
        log("no CUDA device: nothing to check")
        save()
        return 2
    name = torch.cuda.get_device_name() if not RUN.dry else "cpu (dry run)"
    peak = args.peak_gbps or next((v for k, v in PEAKS_GBPS.items() if k in name), None)
    report["device"] = {"name": name, "peak_GBps": peak, "dry_run": RUN.dry,
                        "capability": list(torch.cuda.get_device_capability()) if not RUN.dry else None}
    log(f"device: {name}, peak {peak} GB/s, " + ", ".join(f"{k} {v}" for k, v in pre.items()))
    import gpu_correctness as C
    import gpu_perf as P
    import gpu_tiers as T

    toy = _toy_decode()
    sections: dict[str, Callable[[], Any]] = {
        "correctness": C.section_correctness,
        "runner": lambda: C.section_runner(toy),
        "no_sync": lambda: C.section_no_sync(toy),
        "bandwidth": lambda: P.section_bandwidth(peak),
        "layer_store": (lambda: P.section_layer_store(2, 16)) if RUN.dry else P.section_layer_store,
        "replay": (lambda: P.section_replay(toy, 4, 2)) if RUN.dry else (lambda: P.section_replay(toy)),
        "copy_capture": C.section_copy_capture,
        "shared_pages": C.section_shared_pages,
        "ptx": P.section_ptx,
        "copy_reference": P.section_copy_reference,
        "host_tier": T.section_host_tier,
        "nccl_transfer": P.section_nccl_transfer,  # needs >= 2 GPUs
    }
    assert list(sections) == SECTIONS
    only = args.only
    t_all = time.perf_counter()
    for key, fn in sections.items():
        if only is not None and key not in only:
            continue
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
        save()  # partial results survive a crash
    report["total_s"] = round(time.perf_counter() - t_all, 1)
    report["summary"] = _summary(report)
    # A section that raised has no ok flag, so the summary's flags alone would not show it; and a
    # session (gpu_session.py) reads this exit code as the section's status.
    errors = [k for k in sections if isinstance(report.get(k), dict) and "error" in report[k]]
    report["summary"]["errors"] = errors
    save()
    log(f"summary: {json.dumps(report['summary'])}")
    log(f"wrote {out_path} ({report['total_s']} s)")
    if errors:
        log(f"sections that raised: {', '.join(errors)} (their tracebacks are in the JSON)")
        return 1
    return 0


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if x == x and abs(x) != float("inf") else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets and every section's ok flag, in one place."""
    def get(*path):
        cur: Any = report
        for p in path:
            cur = cur.get(p) if isinstance(cur, dict) else None
        return cur

    oks = {k: v.get("ok", v.get("all_ok")) for k, v in report.items()
           if isinstance(v, dict) and ("ok" in v or "all_ok" in v)}
    runner = report.get("runner", {})
    if isinstance(runner, dict):
        for mode in ("inference_mode", "no_grad"):
            if isinstance(runner.get(mode), dict):
                oks[f"runner:{mode}"] = runner[mode].get("ok")
    return {
        "ok": oks,
        "prefill_min_pct_peak": get("bandwidth", "prefill_min_pct_peak"),
        "prefill_target_pct": 80,
        "layer_store_us": get("layer_store", "store_kv", "us_per_layer"),
        "layer_store_target_us": 2.0,
        "replay_speedup_vs_eager": get("replay", "speedup_run_vs_eager"),
        "host_tier_kernel_min_pct_of_memcpy": get("host_tier", "kernel_min_pct_of_memcpy"),
        "host_tier_copy_min_pct_of_memcpy": get("host_tier", "copy_min_pct_of_memcpy"),
        "host_tier_target_pct": 80,
    }


if __name__ == "__main__":
    sys.exit(main())
