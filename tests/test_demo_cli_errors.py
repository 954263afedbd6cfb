"""Bad ``kvpool demo`` settings end with a one-line usage error and exit status 2,
never a Python traceback, and before any request is served."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpool.cli import main

TINY = ["--requests", "4", "--prompt-len", "4:12", "--output-len", "2:4", "--pool-tokens", "128",
        "--page-size", "16", "--max-running", "4", "--layers", "1", "--hidden", "32", "--heads", "4",
        "--kv-heads", "2", "--vocab", "64", "--no-progress"]

BAD = [
    (["--device", "foo"], "--device"),
    (["--device", "meta"], "cpu or cuda"),
    (["--heads", "3"], "multiple of heads"),
    (["--kv-heads", "3"], "multiple of kv_heads"),
    (["--hidden", "36", "--heads", "4"], "even"),
    (["--seed", "-1"], "--seed"),
    (["--host-pages", "-1"], "--host-pages"),
    (["--host-pages", "1"], "--host-pages 1 is a host tier of only its reserved page 0"),  # was: "host_pages must be"
    (["--workload", "shared-prefix", "--fork-share", "2"], "--fork-share"),
    (["--workload", "shared-prefix", "--fork-share", "nan"], "--fork-share"),
    (["--pool-tokens", "16", "--prompt-len", "20:24"], "enlarge the pool"),
    # Was: the request table and 1e8-token prompts each passed the memory check alone, and
    # together the kernel killed the process (the engine refused them only after).
    (["--prompt-len", "1:100000000"], "enlarge the pool or shorten the requests"),
    (["--pool-tokens", "100000000000"], "2147483647 pages"),  # 2**31 - 1: kvpool._core.MAX_PAGES
    (["--page-size", str(2**63)], f"--page-size {2**63} is longer"),  # the random model's rotary table would fail in torch first
    (["--json", "/nonexistent-dir/x.json"], "--json"),
    (["--json", "/"], "--json"),  # a directory, not a file
    (["--threads", "100000"], "--threads"),  # torch would crash making that many
    (["--hf", "/nonexistent-dir/model"], "--hf"),
    (["--json", ""], "--json: expected a path"),  # was: quietly "not given"
    (["--hf", ""], "--hf: expected a path"),  # was: the random model ran instead
    # Were "invalid _positive value: 'abc'" (argparse names the type function):
    (["--requests", "abc"], "argument --requests: expected a positive integer, got 'abc'"),
    (["--requests", "1.5"], "argument --requests: expected a positive integer, got '1.5'"),
    (["--seed", "x"], "argument --seed: expected an integer >= 0, got 'x'"),
    (["--host-pages", "x"], "argument --host-pages: expected an integer >= 0, got 'x'"),
    (["--workload", "shared-prefix", "--fork-share", "x"], "argument --fork-share: expected a number in [0, 1]"),
    (["--threads", "two"], "argument --threads: expected a positive integer, got 'two'"),
]


@pytest.mark.parametrize("extra, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_setting_is_a_usage_error(capsys, extra, message):
    with pytest.raises(SystemExit) as info:
        main(["demo", *TINY, *extra])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "kvpool demo: error:" in err and message in err, err
    assert "Traceback" not in err


def test_hf_checkpoint_without_weights_is_a_usage_error(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    __import__("_hf_skip").require_hf()  # transformers may refuse this torch
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["demo", *TINY, "--hf", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "kvpool demo: error:" in err and "model.safetensors" in err, err


@pytest.mark.parametrize("config, weights, message", [
    ('{"model_type": "llama", "hidden_size": "x"}', None, "cannot load this checkpoint"),
    ('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 3}', None, "cannot load this checkpoint"),
    (None, b"\xff" * 64, "cannot load this checkpoint"),
], ids=["field-type", "heads", "junk-weights"])
def test_an_hf_checkpoint_the_loaders_refuse_is_a_usage_error(tmp_path, capsys, config, weights, message):
    """transformers and safetensors refuse a bad checkpoint with their own exception types
    (not ValueError): those were tracebacks."""
    transformers = pytest.importorskip("transformers")
    __import__("_hf_skip").require_hf()  # transformers may refuse this torch
    if config is None:
        transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=64).save_pretrained(tmp_path)
    else:
        (tmp_path / "config.json").write_text(config)
    if weights is not None:
        (tmp_path / "model.safetensors").write_bytes(weights)
    with pytest.raises(SystemExit) as info:
        main(["demo", *TINY, "--hf", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "kvpool demo: error:" in err and message in err, err
    assert "Traceback" not in err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_json_target_that_cannot_be_written_at_the_end_is_an_error_not_a_traceback(capsys):
    """/dev/full takes the open and refuses the write: the run's figures cannot be saved,
    which is said in one line with exit status 1."""
    with pytest.raises(SystemExit) as info:
        main(["demo", *TINY, "--json", "/dev/full"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "cannot write --json" in err and "Traceback" not in err, err


def test_usage_error_from_python_dash_m_has_no_traceback():
    res = subprocess.run([sys.executable, "-m", "kvpool", "demo", *TINY, "--device", "foo"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and "kvpool demo: error:" in res.stderr, res.stderr


def test_hf_without_transformers_is_a_usage_error_that_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(SystemExit) as info:
        main(["demo", *TINY, "--hf", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "kvpool demo: error:" in err and "pip install 'kvpool[hf]'" in err, err


def test_version_prints_the_package_version(capsys):
    import kvpool

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvpool {kvpool.__version__}"
