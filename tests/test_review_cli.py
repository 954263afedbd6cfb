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

from kvpool.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--requests", "4", "--prompt-len", "4:12", "--output-len", "2:4", "--pool-tokens", "128",
        "--page-size", "16", "--max-running", "4", "--layers", "1", "--hidden", "32", "--heads", "4",
        "--kv-heads", "2", "--vocab", "64", "--no-progress"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])}


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
    import kvpool.demo.cli as demo_cli
    import kvpool.demo.model as demo_model

    monkeypatch.setattr(demo_cli, "host_memory_bytes", lambda: 1 << 20)
    monkeypatch.setattr(demo_model, "build_model", lambda *a, **k: pytest.fail("built the model anyway"))
    line = _demo_usage_error(capsys, ["--layers", "64"])
    assert "the demo model's weights" in line and "--layers" in line


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
