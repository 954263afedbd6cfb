"""``python -m kvpool.bench overhead``: every section prints and writes its JSON, with
the fields the results file and docs/benchmarks.md quote (figures are not judged
here: speed is checked by the benchmark's own output, never by a test)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvpool.bench import first_burst

# glibc's dynamic mmap threshold is what construction primes (rust/kvpool-py/src/heap_prime.rs).
GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def test_rows_and_burst_sections_write_their_json(tmp_path, capsys):
    from kvpool.bench.__main__ import main

    assert main(["overhead", "--quick", "--sections", "rows,burst", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "write / read over bare" in printed and "fresh pool" in printed
    rows = json.loads((tmp_path / "overhead-rows.json").read_text())
    assert rows["benchmark"] == "overhead/rows"
    cases = {(r["layout"], r["rows"]) for r in rows["results"]}
    assert cases == {(layout, n) for layout in ("token", "paged") for n in (1, 64)}
    for r in rows["results"]:
        for key in ("write", "write_caller", "read", "bare_write", "bare_read", "bare_scatter"):
            assert r[f"{key}_us"] > 0 and r[f"{key}_cpu_us"] > 0
        assert {"write_overhead_us", "write_caller_overhead_us", "read_overhead_us",
                "write_over_scatter_overhead_us"} <= set(r)
    burst = json.loads((tmp_path / "overhead-burst.json").read_text())["results"]
    assert [(r["slots"], r["page_size"]) for r in burst] == [(1 << 20, 1), (1 << 20, 16)]
    for r in burst:
        assert r["tokens"] == int(first_burst.mixed_prompts().sum())
        assert r["construct_ms"] > 0 and r["first_ns_per_token"] > 0 and r["warm_ns_per_token"] > 0
        # The warm admission reuses what the first mapped: no page faults left for it.
        assert r["warm_faults"] == 0
        if GLIBC:
            # Nor for the first: construction faulted in the pool's records and primed the C
            # heap for a result array this size (4 MiB, ~1000 pages when fresh).
            assert r["first_faults"] < 64, r
        assert r["runs"][0]["flush_mib"] >= 64
        # The same run's baseline: the same flow with plain writes instead of a pool.
        assert r["control"]["first_ns_per_token"] > 0 and r["control"]["warm_ns_per_token"] > 0
    assert "plain writes" in printed


def test_hf_section_compares_both_caches_and_checks_their_tokens(tmp_path):
    pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
    __import__("_hf_skip").require_hf()  # transformers may refuse this torch
    from kvpool.bench.__main__ import main

    assert main(["overhead", "--quick", "--sections", "hf", "--hf-lengths", "128:64,1024:128",
                 "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "overhead-hf.json").read_text())
    runs = [doc, *doc["more_lengths"]]
    assert [d["settings"]["prompt_len"] for d in runs] == [16, 32]  # --quick shrinks every length
    for d in runs:
        assert d["token_mismatches"] == 0
        assert [r["batch"] for r in d["results"]] == [1, 8]
        for r in d["results"]:
            assert r["kvpool_tok_s"] > 0 and r["dynamic_tok_s"] > 0 and r["kvpool_over_dynamic_cpu"] > 0
            lo, hi = r["kvpool_over_dynamic_paired_95"]
            assert 0 < lo <= r["kvpool_over_dynamic_paired"] <= hi
            assert r["dynamic_update_us"] > 0 and r["kvpool_update_us"] > 0


def test_median_interval_brackets_the_median_and_narrows_with_more_rounds():
    import random
    import statistics

    from kvpool.bench.hf_generate import median_interval

    rng = random.Random(1)
    few = [1 + rng.gauss(0, 0.05) for _ in range(7)]
    many = [1 + rng.gauss(0, 0.05) for _ in range(200)]
    for xs in (few, many):
        lo, hi = median_interval(xs)
        assert lo <= statistics.median(xs) <= hi
    assert median_interval(many)[1] - median_interval(many)[0] < median_interval(few)[1] - median_interval(few)[0]
    assert median_interval([2.0] * 5) == (2.0, 2.0)


def test_hf_lengths_must_be_prompt_colon_new_tokens(capsys):
    from kvpool.bench.__main__ import main

    for bad in ("128", "128:x", "0:64"):
        with pytest.raises(SystemExit) as exc:
            main(["overhead", "--quick", "--sections", "hf", "--hf-lengths", bad, "--json-prefix", ""])
        assert exc.value.code == 2  # a usage error, before anything runs
        assert "--hf-lengths" in capsys.readouterr().err


def test_first_burst_child_runs_without_importing_torch():
    """The child of each burst run loads the extension alone: seconds of torch start-up
    per fresh process would otherwise swamp a run of a few milliseconds."""
    script = Path(first_burst.__file__)
    code = ("import runpy, sys; sys.argv = ['x', '65536', '16', '64']; "
            f"runpy.run_path({str(script)!r}, run_name='__main__'); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["tokens"] == 256 * 64 and doc["slots"] == 65536 and doc["control"] is False


def test_first_burst_control_writes_what_an_admission_writes():
    """The control's admission fills the table rows an admission fills (each row's first
    count entries) and returns a result of one value a token, without loading the pool."""
    counts = np.array([3, 0, 5], dtype=np.int64)
    table = np.full((4, 8), -1, dtype=np.int32)
    plain = first_burst.PlainWrites(int(counts.sum()))
    handles, out = plain.admit(counts, table)
    assert len(handles) == 3 and out.shape == (8,) and (out == 1).all()
    assert (table[0, :3] == 0).all() and (table[0, 3:] == -1).all()
    assert (table[1] == -1).all()
    assert (table[2, :5] == 2).all() and (table[2, 5:] == -1).all()
    script = Path(first_burst.__file__)
    r = subprocess.run([sys.executable, str(script), "65536", "16", "64", "control"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["control"] is True and doc["first_ns_per_token"] > 0 and doc["warm_ns_per_token"] > 0
