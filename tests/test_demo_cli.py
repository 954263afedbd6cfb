"""End-to-end: the demo command completes under every grad mode with sane figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvpool.cli import main

TINY = ["--requests", "12", "--prompt-len", "4:24", "--output-len", "2:12", "--pool-tokens", "128",
        "--page-size", "16", "--max-running", "8", "--layers", "2", "--hidden", "32", "--heads", "4",
        "--kv-heads", "2", "--vocab", "64", "--no-progress"]


@pytest.mark.parametrize("mode", ["inference", "no_grad", "none"])
def test_demo_runs_under_each_grad_mode(tmp_path, capsys, mode):
    out = tmp_path / "demo.json"
    threads = torch.get_num_threads()
    grad_on, inference_on = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    assert main(["demo", *TINY, "--grad-mode", mode, "--json", str(out)]) == 0
    # The demo's process-wide and thread-local settings do not leak into the caller.
    assert torch.get_num_threads() == threads
    assert (torch.is_grad_enabled(), torch.is_inference_mode_enabled()) == (grad_on, inference_on)
    fig = json.loads(out.read_text())
    assert fig["settings"]["grad_mode"] == mode
    assert fig["requests_done"] == 12
    assert fig["generated_tokens"] >= 12 * 2 and fig["tokens_per_s"] > 0
    for key in ("occupancy", "token_occupancy"):
        occ = fig[key]
        assert 0.0 <= occ["min"] <= occ["mean"] <= occ["max"] <= 1.0, (key, occ)
        assert all(0.0 <= s <= 1.0 for s in occ["samples"])
    assert fig["occupancy"]["max"] > 0.5, "a 128-token pool should fill up with these requests"
    assert fig["steps_blocked_by_pool"] > 0
    assert fig["preemptions"] == 0
    assert 0.0 < fig["pool_host"]["share"] < 1.0
    assert fig["pool_host"]["calls"]["extend"] >= fig["steps"] - 1
    assert fig["settings"]["pages_in_use_at_end"] == 0
    assert fig["settings"]["open_requests_at_end"] == 0
    assert fig["audit"]["clean"] is True, fig["audit"]
    text = capsys.readouterr().out
    assert "12/12 done" in text and "audit" in text


def test_demo_rejects_a_pool_too_small_for_one_request(capsys):
    with pytest.raises(SystemExit) as info:  # a usage error, not a traceback
        main(["demo", *TINY, "--pool-tokens", "16"])
    assert info.value.code == 2
    assert "enlarge the pool" in capsys.readouterr().err


def test_python_dash_m_kvpool_help():
    res = subprocess.run([sys.executable, "-m", "kvpool", "demo", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--grad-mode" in res.stdout and "--cuda-graph" in res.stdout


def test_unknown_command_is_an_error(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_no_command_is_a_usage_error_on_stderr_and_help_is_not(capsys):
    assert main([]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "kvpool: give a command" in out.err and "usage: kvpool demo" in out.err
    assert main(["--help"]) == 0
    out = capsys.readouterr()
    assert out.err == "" and "usage: kvpool demo" in out.out


def test_demo_shared_prefix_workload_reports_hits_and_saved_prefill(tmp_path, capsys):
    out = tmp_path / "demo.json"
    args = ["demo", *TINY, "--workload", "shared-prefix", "--system-prompts", "2", "--system-len", "24:40",
            "--prompt-len", "2:8", "--pool-tokens", "256", "--fork-share", "0.5", "--json", str(out)]
    assert main(args) == 0
    fig = json.loads(out.read_text())
    px = fig["prefix"]
    assert fig["settings"]["workload"] == "shared-prefix" and fig["requests_done"] == 12
    assert 0 < px["hit_tokens"] < px["prompt_tokens"] and px["forks"] > 0
    assert px["prefill_tokens_saved"] == px["hit_tokens"] + px["forked_tokens"]
    # What was saved was not prefilled.
    assert fig["prefill_tokens"] == px["prompt_tokens"] - px["prefill_tokens_saved"]
    assert fig["settings"]["open_requests_at_end"] == 0
    assert fig["pool_host"]["calls"]["open_with_prefix"] == 12 and fig["pool_host"]["calls"]["fork"] > 0
    text = capsys.readouterr().out
    assert "prefix cache" in text and "prefill tokens saved" in text and "12/12 done" in text


def test_demo_host_pages_compares_runs_with_and_without_the_tier(tmp_path, capsys):
    """System prompts that overflow the device pool come back from the host tier: more
    hits and less prefill than the same run without it (the demo runs both)."""
    out = tmp_path / "demo.json"
    args = ["demo", *TINY, "--requests", "48", "--workload", "shared-prefix", "--system-prompts", "12",
            "--system-len", "48:96", "--prompt-len", "4:16", "--output-len", "2:8", "--pool-tokens", "512",
            "--max-running", "4", "--fork-share", "0", "--host-pages", "128", "--json", str(out)]
    assert main(args) == 0
    fig = json.loads(out.read_text())
    tier, base = fig["host_tier"], fig["without_host_tier"]
    assert tier["host_pages"] == 128 and tier["host_hit_tokens"] > 0
    assert tier["offload_bytes"] > 0 and tier["load_bytes"] > 0
    assert fig["prefix"]["hit_rate"] > base["prefix"]["hit_rate"]
    assert fig["prefill_tokens"] < base["prefill_tokens"]
    text = capsys.readouterr().out
    assert "host tier (128 host pages) vs none" in text and "tokens/s" in text


def test_demo_help_states_every_default():
    """`demo --help` is where docs/demo.md sends readers for the model and pool sizes: each
    option with a default says it, "(value)", or for a choice, describes its default first."""
    from kvpool.demo.cli import build_parser

    missing = []
    for action in build_parser()._actions:
        default = action.default
        if action.dest == "help" or default in (None, False) or isinstance(default, bool):
            continue
        text = action.help or ""
        shown = ":".join(map(str, default)) if isinstance(default, tuple) else str(default)
        if not (f"({shown}" in text or (action.choices and text.startswith(f"{default}:"))):
            missing.append(f"{action.option_strings[0]} (default {default!r}): {text!r}")
    assert not missing, missing


def test_demo_expands_a_tilde_in_its_json_path(tmp_path, monkeypatch):
    # `--json=~/x` reaches the program unexpanded: the shell expands `~` only at a word's start.
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["demo", *TINY, "--json=~/figures.json"]) == 0
    assert json.loads((tmp_path / "figures.json").read_text())
