"""Outside review of the command lines (``kvpool demo``, ``python -m kvpool.bench``, benchmarks/*.py):
settings that cannot run (an output that cannot be written, sizes past this machine's memory, a
negative seed) are a one-line usage error (exit 2) before anything runs, never a traceback after it,
nor a process that grows until the machine kills it."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvpool
from kvpool.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--requests", "4", "--prompt-len", "4:12", "--output-len", "2:4", "--pool-tokens", "128",
        "--page-size", "16", "--max-running", "4", "--layers", "1", "--hidden", "32", "--heads", "4",
        "--kv-heads", "2", "--vocab", "64", "--no-progress"]


def _env() -> dict[str, str]:
    # The kvpool this test imported (the installed package under CI, python/ with a built
    # _core in a checkout): python/ of a fresh clone has no _core.
    here = str(Path(kvpool.__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}


def _demo_usage_error(capsys, extra: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(["demo", *TINY, *extra])
    out = capsys.readouterr()
    assert info.value.code == 2, out.err
    assert "Traceback" not in out.err and "kvpool demo: error:" in out.err, out.err
    assert "done in" not in out.out, "the demo ran before refusing"
    return out.err.strip().splitlines()[-1]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no file can be made")
def test_demo_json_in_a_folder_where_no_file_can_be_made_is_refused_before_the_run(capsys):
    line = _demo_usage_error(capsys, ["--json", "/proc/kvpool-demo.json"])
    assert "--json" in line and "cannot write" in line


def test_demo_model_too_large_to_allocate_is_a_usage_error(capsys):
    line = _demo_usage_error(capsys, ["--vocab", str(10**12)])
    assert "cannot allocate the demo model's weights" in line and "--vocab" in line


def test_demo_model_bytes_are_what_the_built_model_holds():
    from kvpool.demo.cli import model_bytes
    from kvpool.demo.model import ModelConfig, build_model

    for dtype in (torch.float32, torch.bfloat16):
        cfg = ModelConfig(vocab_size=70, hidden=48, layers=3, heads=6, kv_heads=2, max_positions=40)
        m = build_model(cfg, dtype=dtype)
        held = sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))
        assert model_bytes(cfg, dtype) == held


def test_demo_model_past_this_machines_memory_is_refused_before_it_is_built(capsys, monkeypatch):
    """Many small tensors (--layers) never fail one allocation: the process grows until the
    kernel kills it. The demo compares the model's bytes with the machine's memory first."""
    import kvpool.demo._args as demo_args
    import kvpool.demo.model as demo_model

    # (where both the model's and the requests' memory checks look it up)
    # 2 MiB: the pool's K/V (1.2 MB at 64 layers) fit, the model's 4 MB do not
    monkeypatch.setattr(demo_args, "host_memory_bytes", lambda: 2 << 20)
    monkeypatch.setattr(demo_model, "build_model", lambda *a, **k: pytest.fail("built the model anyway"))
    line = _demo_usage_error(capsys, ["--layers", "64"])
    assert "the demo model's weights" in line and "--layers" in line


@pytest.mark.parametrize("extra", [["--layers", "64"], ["--pool-tokens", "100000"]])
def test_demo_pool_past_this_machines_memory_is_refused_by_the_demos_flags(capsys, monkeypatch, extra):
    """The pool's own refusal named its parameters (num_pages, num_slots, memory_bytes or
    memory_fraction), none of them a flag of the demo: the demo checks the K/V bytes first."""
    import kvpool.demo._args as demo_args

    monkeypatch.setattr(demo_args, "host_memory_bytes", lambda: 1 << 20)
    monkeypatch.setattr(kvpool, "KVPool", lambda *a, **k: pytest.fail("built the pool anyway"))
    line = _demo_usage_error(capsys, extra)
    assert "the pool's K/V caches" in line and "lower --pool-tokens, --layers" in line, line
    assert "num_pages" not in line


@pytest.mark.parametrize("extra, flag", [
    (["--requests", str(10**9)], "--requests"),
    (["--workload", "shared-prefix", "--system-prompts", str(10**9)], "--system-prompts"),
])
def test_demo_requests_past_this_machines_memory_are_refused_at_once(extra, flag):
    """A billion requests (or system prompts) were generated one by one before anything
    checked them: minutes of CPU, then more memory than the machine has."""
    res = subprocess.run([sys.executable, "-m", "kvpool", "demo", *TINY, *extra], capture_output=True,
                         text=True, timeout=90, env=_env())
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("kvpool demo: error:") and flag in line and "memory" in line, line


def test_demo_seed_past_64_bits_is_refused_by_name(capsys):
    line = _demo_usage_error(capsys, ["--seed", str(2**64)])
    assert "--seed" in line


def test_demo_cuda_without_a_gpu_is_a_usage_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    line = _demo_usage_error(capsys, ["--device", "cuda"])
    assert "--device" in line and "no CUDA device" in line


@pytest.mark.parametrize("command", [["churn", "--quick"], ["prefix", "--quick"], ["route", "--quick"]])
def test_bench_negative_seed_is_a_usage_error(tmp_path, capsys, command):
    from kvpool.bench.__main__ import main as bench_main

    with pytest.raises(SystemExit) as exc:
        bench_main([*command, "--seed", "-1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert "--seed" in err.strip().splitlines()[-1]
    assert list(tmp_path.iterdir()) == []


def test_bench_pool_negative_seed_is_a_usage_error(monkeypatch, tmp_path, capsys):
    """numpy's generator takes no negative seed: the run ended in its ValueError."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    mod = importlib.import_module("bench_pool")
    with pytest.raises(SystemExit) as exc:
        mod.main(["--seed", "-1", "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err and "--seed" in err, err
    assert list(tmp_path.iterdir()) == []


def test_demo_json_is_strict_and_has_the_documented_figures(tmp_path):
    out = tmp_path / "demo.json"
    res = subprocess.run([sys.executable, "-m", "kvpool", "demo", *TINY, "--json", str(out)],
                         capture_output=True, text=True, timeout=180, env=_env())
    assert res.returncode == 0, res.stderr
    fig = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert fig["requests_done"] == 4 and fig["audit"]["clean"] is True
    assert fig["generated_tokens"] == fig["decode_tokens"] + 4  # the first token of each comes from prefill


# The allocator's bounds (kvpool._core's MAX_PAGES, MAX_REQUESTS, MAX_CONTEXT_LEN) reached from a
# command line: the core's InvalidArgumentError names its parameter, not the flag, and came out as
# a traceback. Each is a usage error that names the flag and the bound, before anything runs.
def _bounds():
    from kvpool._core import MAX_CONTEXT_LEN, MAX_PAGES, MAX_REQUESTS

    return {"pages": MAX_PAGES, "requests": MAX_REQUESTS, "context": MAX_CONTEXT_LEN}


def test_core_exports_the_bounds_it_enforces():
    import kvpool

    b = _bounds()
    for args, bound in [((b["pages"] + 1, 1, 1, 16), b["pages"]), ((2, 1, b["requests"] + 1, 16), b["requests"]),
                        ((2, 1, 1, b["context"] + 1), b["context"])]:
        with pytest.raises(kvpool.InvalidArgumentError, match=str(bound)):
            kvpool.SlotAllocator(*args)


def _bench_usage_error(capsys, tmp_path, argv: list[str]) -> str:
    from kvpool.bench.__main__ import main as bench_main

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        bench_main([*argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert not out.exists() or list(out.iterdir()) == [], "the bench wrote files before refusing"
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"python -m kvpool.bench {argv[0]}: error:"), line
    return line


@pytest.mark.parametrize("argv, flag, bound", [
    (["churn", "--quick", "--allocators", "kvpool", "--pool-sizes", "1000G"], "--pool-sizes", "pages"),
    (["prefix", "--quick", "--allocators", "kvpool", "--pool-sizes", "1000G"], "--pool-sizes", "pages"),
    (["hybrid", "--quick", "--allocators", "kvpool", "--pool-sizes", "1000G"], "--pool-sizes", "pages"),
    (["ops", "--quick", "--pool-size", "1000G"], "--pool-size", "pages"),
    (["ops", "--quick", "--pool-size", "1G", "--batch-sizes", "100000000"], "--batch-sizes", "requests"),
    (["churn", "--quick", "--concurrency", "100000000"], "--concurrency", "requests"),
    (["prefix", "--quick", "--concurrency", "100000000"], "--concurrency", "requests"),
    (["churn", "--quick", "--prompt", "1:1000000000"], "--prompt", "context"),
    (["hybrid-memory", "--budgets", "2000000G", "--page-size", "1"], "--budgets", "pages"),
    (["hybrid-memory", "--max-requests", "100000000"], "--max-requests", "requests"),
    (["events", "--sizes", "1000000000000"], "--sizes", "pages"),
])
def test_bench_sizes_past_the_allocators_bounds_are_usage_errors(capsys, tmp_path, argv, flag, bound):
    line = _bench_usage_error(capsys, tmp_path, argv)
    assert flag in line and str(_bounds()[bound]) in line, line


@pytest.mark.parametrize("argv, flags", [
    (["hybrid-memory", "--layers", "100000000"], ["--budgets", "--layers"]),
    (["hybrid-memory", "--budgets", "1M"], ["--budgets"]),
    (["hybrid-memory", "--context", "1000000000"], ["--context", "268435455"]),
    (["events", "--page-size", "100000000"], ["--page-size"]),
])
def test_bench_shapes_the_allocator_cannot_build_are_usage_errors(capsys, tmp_path, argv, flags):
    line = _bench_usage_error(capsys, tmp_path, argv)
    assert all(f in line for f in flags), line


def test_hybrid_memory_pool_this_machine_cannot_hold_is_a_usage_error(capsys, tmp_path, monkeypatch):
    """Within the bounds, a budget's metadata can still be more than the machine's memory: the
    core's typed refusal is reported against the flags that size the pools."""
    import kvpool
    import kvpool.bench.hybrid_memory as hm

    def refuse(*a, **k):
        raise kvpool.InvalidArgumentError("cannot allocate slot token ids: 11251206944 entries of 4 bytes")

    monkeypatch.setattr(hm, "run", refuse)
    line = _bench_usage_error(capsys, tmp_path, ["hybrid-memory", "--budgets", "80G"])
    assert "--budgets" in line and "cannot allocate" in line, line


@pytest.mark.parametrize("extra, flag, bound", [
    (["--max-running", "100000000"], "--max-running", "requests"),
    (["--prompt-len", "4:1000000000"], "--prompt-len", "context"),
    (["--host-pages", "3000000000"], "--host-pages", "pages"),
    (["--pool-tokens", "100000000000", "--page-size", "1"], "--pool-tokens", "pages"),
])
def test_demo_sizes_past_the_allocators_bounds_name_the_flag(capsys, extra, flag, bound):
    line = _demo_usage_error(capsys, extra)
    assert flag in line and str(_bounds()[bound]) in line, line
