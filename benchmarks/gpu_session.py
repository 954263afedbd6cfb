"""One GPU session, one command: `bash benchmarks/gpu_session.sh` (which runs this).

Runs every check a bare GPU box can do with the carried python/kvpool/_core.abi3.so
(no Rust, no network), each section in its own process with a hard time budget, in
this order, so that a session that is cut short still has the most basic answers:

  env          versions, GPU and driver (nvidia-smi), glibc of the box and the one
               the carried .so needs                                  env.json
  preflight    KVPool.write / read (store_kv, gather_kv) on bf16 and fp8 pools:
               does the .so load and does Triton compile and run here  preflight.json
  codegen      tests/test_kernels_codegen.py on the box's Triton        codegen.xml
  gpu_check    benchmarks/gpu_check.py under its own --budget-s          gpu_check.json
  host_us      host us per extend(B=256), admit, eager write, runner.run host_us.json
  launch       an eager write's host us, part by part, against Triton's
               own launch path and a bare launcher                      launch.json
  hf           generate tokens/s, KVPoolCache against DynamicCache, on
               the GPU (benchmarks/bench_hf.py --device cuda)           hf.json
  hf_split     where generate's host time goes on the GPU: the caches'
               update (and KVPoolCache.update's parts), attention, the
               rest (benchmarks/hf_split.py --device cuda --parts)       hf_split.json
  hf_diff      the functions whose own time differs most between generate
               with KVPoolCache and with DynamicCache, batch 8, cProfile of
               the whole calls (benchmarks/hf_profile_diff.py)          hf_diff.json
  cuda_tests:F every test file that needs CUDA (tests/test_*cuda*.py and any file
               that skips without CUDA), one section per file, with
               KVPOOL_CHECK_LAUNCH=1                                    cuda_tests/F.xml
  shapes       store/gather/copy_slots GB/s for fp8, MLA 576, head_dim 64 and 72,
               one KV head, page 16; the PTX access opcodes each got     shapes.json

Everything goes under --out (default $OUT, else ./gpu_session_out): the JSON
figures, logs/<section>.log (stdout + stderr), and session.json: each section's
status (ok / failed / timeout / skipped), exit code, seconds and log tail,
rewritten after every section. A failing or timed-out section is recorded and the
next one runs. No section starts once the session's total budget (--total-s,
default 470 s) is spent, and a section's budget is cut to what is left, so the
whole run ends within the total plus the few seconds a kill takes.

--device cpu is a dry run of the same logic on a machine without a GPU: smaller
sizes and a codegen subset (tests/test_gpu_session.py runs it). --only a,b runs
those sections (a prefix such as cuda_tests selects every file).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
TESTS = ROOT / "tests"
KILL_GRACE_S = 5.0
# A test file needs CUDA when its name says so or it skips itself without CUDA.
_SKIPS_WITHOUT_CUDA = re.compile(r"skipif\(\s*not\s+(torch\.cuda\.is_available\(\)|CUDA\b)")


@dataclass
class Section:
    name: str
    budget_s: float
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)


def cuda_test_files(tests: Path = TESTS) -> list[Path]:
    """tests/test_*cuda*.py, then every other test file that skips itself without CUDA."""
    named = sorted(tests.glob("test_*cuda*.py"))
    others = sorted(p for p in tests.glob("test_*.py")
                    if p not in named and p.name != "test_gpu_session.py"
                    and _SKIPS_WITHOUT_CUDA.search(p.read_text(errors="replace")))
    return named + others


def plan(out: Path, device: str, py: str = sys.executable) -> list[Section]:
    dry = device == "cpu"
    dev = ["--device", device]
    pytest = [py, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-o", "addopts="]
    # On the box the whole codegen matrix; in a dry run a subset that still compiles
    # both the 16-bit and the fp8 paths.
    codegen_k = ["-k", "store_kv_codegen and fp8 and h8d64 and decode-token or analysis"] if dry else []
    sections = [
        Section("env", 20, [py, str(BENCH / "gpu_env.py"), "--out", str(out / "env.json"), *dev]),
        Section("preflight", 45, [py, str(BENCH / "gpu_preflight.py"), "--out", str(out / "preflight.json"), *dev]),
        Section("codegen", 60, [*pytest, str(TESTS / "test_kernels_codegen.py"), *codegen_k,
                                f"--junitxml={out / 'codegen.xml'}"]),
        Section("gpu_check", 150, [py, str(BENCH / "gpu_check.py"), "--out", str(out / "gpu_check.json"),
                                   "--budget-s", "100", *dev]
                + (["--only", "correctness,runner,shared_pages,host_tier"] if dry else [])),
        Section("host_us", 40, [py, str(BENCH / "gpu_host.py"), "--out", str(out / "host_us.json"), *dev]),
        Section("launch", 40, [py, str(BENCH / "gpu_launch.py"), "--out", str(out / "launch.json"), *dev]),
        Section("hf", 60, [py, str(BENCH / "bench_hf.py"), "--out", str(out / "hf.json"), *dev]
                + (["--rounds", "1", "--batches", "1", "--prompt-len", "16", "--new-tokens", "4"] if dry
                   else ["--rounds", "3"])),
        Section("hf_split", 60, [py, str(BENCH / "hf_split.py"), "--parts", "--out", str(out / "hf_split.json"), *dev]
                + (["--rounds", "1", "--prompt-len", "16", "--new-tokens", "4"] if dry else ["--rounds", "3"])),
        Section("hf_diff", 60, [py, str(BENCH / "hf_profile_diff.py"), "--out", str(out / "hf_diff.json"), *dev]
                + (["--rounds", "1", "--batch", "1", "--new-tokens", "4"] if dry else ["--rounds", "3"])),
    ]
    for f in cuda_test_files():
        # Every cached Triton launch in these tests is checked against the kernel Triton
        # itself would pick (kvpool/kernels/launch.py).
        sections.append(Section(f"cuda_tests:{f.stem}", 90,
                                [*pytest, str(f), f"--junitxml={out / 'cuda_tests' / (f.stem + '.xml')}"],
                                env={"KVPOOL_CHECK_LAUNCH": "1"}))
    # Last: supplementary figures, saved after every shape, so a cut run keeps what ran.
    sections.append(Section("shapes", 60, [py, str(BENCH / "gpu_shapes.py"), "--out", str(out / "shapes.json"), *dev]))
    return sections


def _tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def run_section(sec: Section, out: Path, budget_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Run one section in its own process group; kill the group when the budget is spent."""
    log = out / "logs" / f"{sec.name.replace(':', '_')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cpu0 = _children_cpu_s()
    with open(log, "w") as fh:
        fh.write(f"$ {' '.join(sec.cmd)}\n(budget {budget_s:.0f} s)\n")
        fh.flush()
        proc = subprocess.Popen(sec.cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                env={**env, **sec.env}, start_new_session=True)
        timed_out = False
        try:
            rc: int | None = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode
    seconds = round(time.perf_counter() - t0, 2)
    status = "timeout" if timed_out else ("ok" if rc == 0 else "failed")
    return {"status": status, "rc": rc, "seconds": seconds, "cpu_s": round(_children_cpu_s() - cpu0, 2),
            "budget_s": round(budget_s, 1),
            "log": str(log.relative_to(out)), "tail": _tail(log)}


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of the finished child processes so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def selected(sections: Sequence[Section], only: str | None) -> list[Section]:
    if not only:
        return list(sections)
    keys = [k.strip() for k in only.split(",") if k.strip()]
    return [s for s in sections if any(s.name == k or s.name.startswith(k + ":") for k in keys)]


def run_session(sections: Sequence[Section], out: Path, total_s: float, device: str,
                min_start_s: float = 5.0) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # The checkout's package when its compiled _core is there (the carried .so);
    # otherwise whichever kvpool the caller's environment imports (an installed one).
    has_core = any((ROOT / "python" / "kvpool").glob("_core*.so"))
    paths = ([str(ROOT / "python")] if has_core else []) + [str(BENCH), str(TESTS)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["OUT"] = str(out)
    env.setdefault("PYTHONUNBUFFERED", "1")
    report: dict[str, Any] = {"device": device, "total_budget_s": total_s,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sections": {}}
    path = out / "session.json"
    t_start = time.perf_counter()
    for sec in sections:
        left = total_s - (time.perf_counter() - t_start)
        if left < min_start_s:
            report["sections"][sec.name] = {"status": "skipped", "reason": f"session budget {total_s:.0f} s spent"}
        else:
            budget = min(sec.budget_s, left)
            print(f"== {sec.name} (budget {budget:.0f} s)", flush=True)
            r = run_section(sec, out, budget, env)
            report["sections"][sec.name] = r
            print(f"   {r['status']} in {r['seconds']} s (rc {r['rc']}); log {r['log']}", flush=True)
        report["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        path.write_text(json.dumps(report, indent=2))
    statuses = [s["status"] for s in report["sections"].values()]
    report["summary"] = {k: statuses.count(k) for k in ("ok", "failed", "timeout", "skipped")}
    path.write_text(json.dumps(report, indent=2))
    print(f"session: {report['summary']} in {report['elapsed_s']} s; {path}", flush=True)
    return report


def _positive(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give seconds > 0") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{x:g} must be > 0 seconds")
    return x


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else ./gpu_session_out)")
    ap.add_argument("--total-s", type=_positive, default=470.0, help="session budget in seconds (default 470)")
    ap.add_argument("--only", default=None, help="comma-separated section names (or prefixes)")
    ap.add_argument("--list", action="store_true", help="print the sections and their budgets, run nothing")
    args = ap.parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or "gpu_session_out").resolve()
    if out.exists() and not out.is_dir():
        ap.error(f"--out {out} is a file; give a folder for the session's files")
    every = plan(out, args.device)
    sections = selected(every, args.only)
    names = sorted({s.name.split(":")[0] for s in every})
    unmatched = [k for k in (args.only or "").split(",") if k.strip() and not selected(every, k)]
    if unmatched or (args.only is not None and not sections):
        ap.error(f"--only {','.join(unmatched) or repr(args.only)}: no such section; choose from {','.join(names)}")
    if args.list:
        for s in sections:
            print(f"{s.name:40} {s.budget_s:5.0f} s  {' '.join(s.cmd)}")
        return 0
    report = run_session(sections, out, args.total_s, args.device)
    return 0 if report["summary"]["failed"] == report["summary"]["timeout"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
