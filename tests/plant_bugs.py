"""Mutation check: plant known bugs one at a time and show the suite catches each.

Each mutant is a text substitution in one file of a temporary copy of the
repository (the tracked files; this checkout is never touched). Mutants in
Rust rebuild the extension in the copy (the quick FAST profile, with a shared
target directory so only the changed crates recompile); Python mutants reuse
the unmutated module built once at the start. Then the mutant's test files
run; the mutant is CAUGHT when pytest fails.

A mutant whose target text is absent (the code it plants a bug in was
rewritten, e.g. by the shared-pages core) is reported NOT APPLICABLE, never as
caught; one that needs a test-only hook the build lacks is reported NEEDS HOOK.
Exit status 1 if any applicable mutant survives or the unmutated copy fails
its own tests.

Usage: python tests/plant_bugs.py [--group planted|fixes|all] [--only NAME ...] [--keep]
Takes several minutes (one Rust build per Rust mutant).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = Path(tempfile.gettempdir()) / "kvpool-mutants-target"
HOOK = "_set_counters_for_tests"


@dataclass
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: list[str]
    needs_hook: bool = False
    group: str = "planted"

    @property
    def rust(self) -> bool:
        return self.path.endswith(".rs")


MUTANTS = [
    # Counters, handle generations, memory figures, the GIL, kernels on CPU.
    Mutant("exhausted-free-slots-without-page-size", "rust/kvpool-core/src/allocator/extend_checks.rs",
           "free_slots: available * self.geo.page_size,", "free_slots: available,",
           ["tests/test_allocator_counters.py"]),
    Mutant("generation-wraps-to-0", "rust/kvpool-core/src/handle.rs",
           "if g >= MAX_GENERATION {\n        1", "if g >= MAX_GENERATION {\n        0",
           ["tests/test_allocator_counters.py"], needs_hook=True),
    Mutant("metadata-bytes-ignores-page-lists", "rust/kvpool-core/src/requests/mod.rs",
           " + self.page_lists.capacity();", ";",
           ["tests/test_allocator_counters.py"]),
    Mutant("epoch-wrap-keeps-stamps", "rust/kvpool-core/src/requests/handles.rs",
           "self.rows.iter_mut().for_each(|r| r.stamp = 0);", "",
           ["tests/test_allocator_counters.py"], needs_hook=True),
    Mutant("truncate-holds-gil", "rust/kvpool-py/src/allocator_release.rs",
           "py.detach(|| self.lock().truncate(&h, counts_of(&l)))",
           "(|| self.lock().truncate(&h, counts_of(&l)))()",
           ["tests/test_allocator_threads.py"]),
    Mutant("check-holds-gil", "rust/kvpool-py/src/allocator.rs",
           "py.detach(|| self.lock().check())", "(|| self.lock().check())()",
           ["tests/test_allocator_threads.py"]),
    Mutant("overhead-bytes-without-fp8-scales", "python/kvpool/pool_views.py",
           "return table + scales + int(self.allocator.metadata_bytes)",
           "return table + int(self.allocator.metadata_bytes)",
           ["tests/test_memory_figures.py"]),
    Mutant("gather-kv-ignores-out-on-cpu", "python/kvpool/kernels/ops.py",
           "    gather_rows(k_cache, v_cache, slots, k_out, v_out, out_dtype, k_scale, v_scale, kg, vg)\n"
           "    return k_out, v_out",
           "    if not c.use_triton(k_cache):\n"
           "        return _ref.gather_kv_ref(k_cache, v_cache, slots, out_dtype, k_scale, v_scale)\n"
           "    gather_rows(k_cache, v_cache, slots, k_out, v_out, out_dtype, k_scale, v_scale, kg, vg)\n"
           "    return k_out, v_out",
           ["tests/test_kernels.py"]),
    Mutant("memory-fraction-ignored-on-cpu", "python/kvpool/capacity.py",
           "            budget = int(free_device_memory(device) * fraction_of_memory(memory_fraction))",
           "            fraction = fraction_of_memory(memory_fraction)\n"
           "            budget = int(free_device_memory(device) * (fraction if device.type != 'cpu' else 1.0))",
           ["tests/test_memory_figures.py"]),
    # Also caught by a Rust test or test_modes; here to prove the Python suite sees them too.
    Mutant("stale-reported-as-unknown", "rust/kvpool-core/src/requests/handles.rs",
           "                    HandleProblem::Stale\n                } else",
           "                    HandleProblem::Unknown\n                } else",
           ["tests/test_allocator_counters.py"]),
    Mutant("persistent-nested-the-wrong-way", "python/kvpool/modes.py",
           "    with torch.inference_mode(False), torch.no_grad():",
           "    with torch.no_grad(), torch.inference_mode(False):",
           ["tests/test_modes.py"]),
    # Bad-input guards, each undone: every regression test must fail without the guard it covers.
    Mutant("fix3-slot-limit-unchecked", "python/kvpool/capacity.py",
           "if pages * page_size > MAX_SLOTS:", "if False:",
           ["tests/test_bad_input_catalogue.py"], group="fixes"),
    Mutant("fix4-uint64-slots-wrap", "python/kvpool/validate.py",
           'if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:', "if False:",
           ["tests/test_bad_input_catalogue.py"], group="fixes"),
    Mutant("fix5-extend-not-rolled-back", "python/kvpool/extending.py",
           "self.allocator.roll_back_extend(hs[::-1].copy(), np.asarray(starts, dtype=np.int64)[::-1].copy())",
           "pass",
           ["tests/test_pool_extend_rollback.py"], group="fixes"),
    Mutant("fix5-rollback-in-batch-order", "python/kvpool/extending.py",
           "self.allocator.roll_back_extend(hs[::-1].copy(), np.asarray(starts, dtype=np.int64)[::-1].copy())",
           "self.allocator.roll_back_extend(hs.copy(), np.asarray(starts, dtype=np.int64).copy())",
           ["tests/test_pool_extend_rollback.py"], group="fixes"),
    Mutant("fix5-meta-device-accepted", "python/kvpool/pool.py",
           'if self.device.type not in ("cpu", "cuda"):', "if False:",
           ["tests/test_pool_extend_rollback.py"], group="fixes"),
    Mutant("fix8-float-num-pages-truncated", "python/kvpool/capacity.py",
           'pages = _count("num_pages", num_pages, "2 (page 0 is reserved)")', "pages = int(num_pages)",
           ["tests/test_bad_input_catalogue.py"], group="fixes"),
    Mutant("fix8-memory-bytes-unchecked", "python/kvpool/capacity.py",
           'budget = budget_bytes("memory_bytes", memory_bytes)', "budget = int(memory_bytes)",
           ["tests/test_bad_input_catalogue.py"], group="fixes"),
    Mutant("fix8-bool-accepted-as-int", "rust/kvpool-py/src/convert.rs",
           "if obj.is_instance_of::<PyBool>() {", "if false {",
           ["tests/test_bad_input_catalogue.py"], group="fixes"),
    Mutant("fix8-result-sized-past-max-context-len", "rust/kvpool-py/src/output.rs",
           ".filter(|&c| c <= max_context_len)\n            .and_then", "\n            .and_then",
           ["tests/test_bad_input_catalogue.py"], group="fixes"),
    Mutant("fix10-not-weak-referenceable", "rust/kvpool-py/src/allocator.rs",
           "frozen, weakref)]", "frozen)]",
           ["tests/test_allocator.py"], group="fixes"),
    # Python-side guards (threads, capture, hostile peers, TP), undone one at a time.
    Mutant("fix-extend-copies-outside-the-pool-lock", "python/kvpool/extending.py",
           "        lock = self._lock\n        acquire_interruptible(lock)",
           "        lock = __import__('threading').RLock()\n        acquire_interruptible(lock)",
           ["tests/test_pool_threads.py"], group="fixes"),
    Mutant("fix-reset-without-the-pool-lock", "python/kvpool/lifecycle.py",
           "        with self._lock:\n            self.allocator.reset()\n            self._note_edit(None)",
           "        self.allocator.reset()\n        self._note_edit(None)",
           ["tests/test_pool_threads.py"], group="fixes"),
    Mutant("fix-no-capture-guard", "python/kvpool/streams.py",
           "    if capturing(device):\n        raise TensorDeviceError(", "    if False:\n        raise TensorDeviceError(",
           ["tests/test_pool_streams.py"], group="fixes"),
    Mutant("fix-no-cross-stream-wait", "python/kvpool/streams.py",
           "        self._current().wait_event(self._event)", "        pass",
           ["tests/test_pool_streams.py"], group="fixes"),
    # CUDA-only branches, run on the CPU by forcing the device path (stop 85).
    Mutant("fix-cuda-store-reads-overwritten-rows", "python/kvpool/kernels/ops.py",
           "    if not (k_cache.is_cuda and torch.compiler.is_compiling()):", "    if not k_cache.is_cuda:",
           ["tests/test_store_rows_cuda_branch.py"], group="fixes"),
    Mutant("fix-hybrid-device-slots-left-on-host", "python/kvpool/hybrid_rows.py",
           "        idx, negative = self._device_slots(idx, negative)", "        idx, negative = idx, negative",
           ["tests/test_hybrid_device_rows.py"], group="fixes"),
    Mutant("fix-transfer-run-in-capture", "python/kvpool/tiers/transfers.py",
           '        refuse_staging_in_capture(self.device, "TransferRunner.run")', "        pass",
           ["tests/test_transfer_capture.py"], group="fixes"),
    Mutant("fix-transfer-header-unchecked", "python/kvpool/distributed/kv_receive.py",
           "    problem = header_problem(pool, header, src_scales)", "    problem = None",
           ["tests/test_transfer_hostile.py"], group="fixes"),
    Mutant("fix-transfer-staging-always-kept", "python/kvpool/distributed/chunks.py",
           "    keep = n * 2 <= KEEP_STAGING_BYTES", "    keep = True",
           ["tests/test_transfer_hostile.py"], group="fixes"),
    Mutant("fix-send-without-the-pool-lock", "python/kvpool/distributed/kv_transfer.py",
           "    with _pool_lock(pool):\n        return _send_request(", "    if True:\n        return _send_request(",
           ["tests/test_pool_threads.py"], group="fixes"),
    Mutant("fix-tp-admit-not-recorded", "python/kvpool/distributed/tp.py",
           '"open", "admit", "extend"', '"open", "extend"',
           ["tests/test_tp_digest.py"], group="fixes"),
    Mutant("fix-cache-pages-row-words", "python/kvpool/distributed/pages.py",
           "layers = cache.view(cache.shape[0], -1).view(torch.uint8).view(word)",
           "layers = cache.view(torch.uint8).view(word)",
           ["tests/test_transfer_pages.py"], group="fixes"),
    # Device-path, rollback, page-run, reorder and TP-digest bugs.
    Mutant("packed-segments-without-padding", "python/kvpool/packed.py",
           "return n + (n & 1)", "return n",
           ["tests/test_pool_device_path.py"]),
    Mutant("prefix-rows-lengths-misaligned", "python/kvpool/sharing.py",
           "lengths[keep], slots)", "lengths[: len(keep)], slots)",
           ["tests/test_pool_device_path.py"]),
    Mutant("runs-join-descending-pages", "python/kvpool/distributed/pages.py",
           "np.diff(p) != 1", "np.abs(np.diff(p)) != 1",
           ["tests/test_transfer_pages.py"]),
    Mutant("reorder-leaks-forks", "python/kvpool/integrations/_reorder.py",
           "    if made:\n        batch.pool.close(np.asarray(made, dtype=np.int64))",
           "    pass",
           ["tests/test_hf_reorder_failure.py"]),
    Mutant("tp-digest-ignores-results", "python/kvpool/distributed/tp.py",
           "        part(_bytes(out))", "        pass",
           ["tests/test_tp_digest.py"]),
]


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, quiet: bool = True) -> int:
    out = subprocess.DEVNULL if quiet else None
    return subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=out).returncode


def build(copy: Path) -> bool:
    """FAST build of the extension in `copy`, installed into its python/kvpool."""
    env = {**os.environ, "PYO3_PYTHON": sys.executable, "CARGO_TARGET_DIR": str(TARGET),
           "CARGO_PROFILE_RELEASE_LTO": "off", "CARGO_PROFILE_RELEASE_CODEGEN_UNITS": "16",
           "CARGO_PROFILE_RELEASE_OPT_LEVEL": "2"}
    if run(["cargo", "build", "--release", "-p", "kvpool-py"], copy, env) != 0:
        return False
    shutil.copyfile(TARGET / "release" / "lib_core.so", copy / "python/kvpool/_core.abi3.so")
    return True


def pytest(copy: Path, tests: list[str], show: bool = False) -> int:
    env = {**os.environ, "PYTHONPATH": str(copy / "python")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    r = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)
    if show and r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-2000:], file=sys.stderr)
    return r.returncode


def has_hook(copy: Path) -> bool:
    env = {**os.environ, "PYTHONPATH": str(copy / "python")}
    code = f"import sys, kvpool; sys.exit(0 if hasattr(kvpool.SlotAllocator, {HOOK!r}) else 1)"
    return run([sys.executable, "-c", code], copy, env) == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="mutant names to run (default: the --group)")
    ap.add_argument("--group", choices=["planted", "fixes", "all"], default="planted",
                    help="planted: the known bugs; fixes: the guards undone one at a time")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = ap.parse_args()
    mutants = [m for m in MUTANTS if (m.name in args.only if args.only else args.group in ("all", m.group))]

    tmp = Path(tempfile.mkdtemp(prefix="kvpool-mutants-"))
    copy = tmp / "repo"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    copy.mkdir()
    for rel in filter(None, files.decode().split("\0")):
        if (ROOT / rel).is_file():
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            # copy, not copy2: fresh mtimes, so cargo never trusts a build of a
            # mutated file left in the shared target directory by an earlier run.
            shutil.copy(ROOT / rel, copy / rel)
    print(f"copy: {copy}; building the unmutated extension ...", flush=True)
    if not build(copy):
        print("the unmutated copy does not build", file=sys.stderr)
        return 1
    clean_so = (copy / "python/kvpool/_core.abi3.so").read_bytes()
    hook = has_hook(copy)
    baseline = sorted({t for m in mutants for t in m.tests})
    if pytest(copy, baseline, show=True) != 0:
        print(f"the unmutated copy fails {baseline}; fix that first", file=sys.stderr)
        return 1

    results: list[tuple[str, str]] = []
    for m in mutants:
        path = copy / m.path
        text = path.read_text()
        if text.count(m.old) != 1:
            results.append((m.name, "NOT APPLICABLE (target code absent)"))
        elif m.needs_hook and not hook:
            results.append((m.name, f"NEEDS HOOK (SlotAllocator.{HOOK} not in this build)"))
        else:
            path.write_text(text.replace(m.old, m.new))
            try:
                if m.rust and not build(copy):
                    verdict = "CAUGHT (does not compile)"
                else:
                    rc = pytest(copy, m.tests)
                    verdict = f"CAUGHT by {' '.join(m.tests)}" if rc != 0 else "SURVIVED"
            finally:
                path.write_text(text)
                if m.rust:  # the next Python mutant runs against the unmutated build
                    (copy / "python/kvpool/_core.abi3.so").write_bytes(clean_so)
            results.append((m.name, verdict))
        print(f"{m.name:40s} {results[-1][1]}", flush=True)

    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    survived = [n for n, v in results if v == "SURVIVED"]
    print(f"\n{sum(v.startswith('CAUGHT') for _, v in results)} caught, {len(survived)} survived, "
          f"{sum(not v.startswith(('CAUGHT', 'SURVIVED')) for _, v in results)} not run here")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
