"""python -m kvpool.bench: a bad flag is a usage error (exit 2, one line naming the flag and what it
takes) before anything runs or is written; --quick never overrides a flag given explicitly; the
JSON files are strict JSON."""

import json

import pytest

from kvpool.bench.__main__ import main

BAD = [
    ("churn", ["--steps", "0"], "--steps"),
    ("churn", ["--warmup", "-1"], "--warmup"),
    ("churn", ["--pool-sizes", "-1"], "--pool-sizes"),
    ("churn", ["--page-sizes", "0"], "--page-sizes"),
    # A pool the page size does not divide, or of one page: the message names the flag (it said
    # "num_slots ... page_size ...", fields of an internal config).
    ("churn", ["--page-sizes", "3"], "--pool-sizes 65536 is not a whole number of pages of 3"),
    ("churn", ["--pool-sizes", "16", "--page-sizes", "16"], "--pool-sizes 16 holds 1 page(s) of 16"),
    ("prefix", ["--pool-sizes", "1000", "--page-sizes", "16"], "--pool-sizes 1000 is not a whole number"),
    ("hybrid", ["--pool-sizes", "1000"], "--pool-sizes 1000 is not a whole number"),
    ("churn", ["--concurrency", "0"], "--concurrency"),
    ("churn", ["--allocators", ""], "--allocators"),
    ("churn", ["--prompt", "5:1"], "lo <= hi"),
    ("churn", ["--target-repeats", "0"], "--target-repeats"),
    ("churn", ["--ref-pool", "3M"], "--ref-pool 3M"),
    ("churn", ["--ref-concurrency", "7"], "--ref-concurrency 7"),
    ("prefix", ["--repeats", "0"], "--repeats"),
    ("prefix", ["--scenarios", "parallel", "--concurrency", "2"], "parallel_n"),
    ("prefix", ["--reuse", "no-such-run.json"], "--reuse"),
    ("hybrid", ["--window", "0"], "--window"),
    ("hybrid", ["--sliding-cache-share", "1.5"], "--sliding-cache-share"),
    ("ops", ["--ops", "opne"], "unknown op 'opne'"),
    ("ops", ["--iters", "0"], "--iters"),
    ("ops", ["--page-sizes", "3", "--pool-size", "64K"], "--pool-size"),
    ("ops", ["--pool-size", "4K"], "--pool-size"),
    ("overhead", ["--sections", "rows,burts"], "unknown section 'burts'"),
    ("overhead", ["--rounds", "0"], "--rounds"),
    ("overhead", ["--hf-lengths", "128:x"], "--hf-lengths"),
    ("route", ["--fill", "0"], "--fill"),
    ("route", ["--pool-slots", "100"], "--pool-slots"),
    ("route", ["--lanes", "0"], "--lanes"),
    ("route", ["--pools", "100000"], "--pools"),  # past the router's 65536 (was: minutes of building pools)
    # a fleet of under two pages: was the trace config's "--pool-sizes 0 holds 0 page(s)", a flag route lacks
    ("route", ["--pools", "1", "--pool-slots", "16", "--page-size", "16", "--fill", "0.5"],
     "--pools 1 x --pool-slots 16 x --fill 0.5 fill 0 page(s) of 16 slots"),
    ("events", ["--sizes", "10,x"], "--sizes"),
    ("hybrid-memory", ["--full-every", "0"], "--full-every"),
    ("hybrid-memory", ["--full-every", "99"], "--full-every 99"),
]


def _usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("command,argv,says", BAD, ids=[f"{c} {' '.join(a)}" for c, a, _ in BAD])
def test_a_bad_flag_is_a_usage_error_before_anything_runs(tmp_path, capsys, command, argv, says):
    quick = ["--quick"] if command in ("churn", "prefix", "hybrid", "ops", "overhead", "route") else []
    line = _usage_error([command, *quick, *argv, "--out", str(tmp_path / "new" / "out")], capsys)
    assert f"python -m kvpool.bench {command}: error:" in line and says in line
    assert list(tmp_path.iterdir()) == []  # nothing written, no folder made


def test_torch_threads_must_be_positive(capsys):
    line = _usage_error(["--torch-threads", "0", "ops", "--quick", "--ops", "open", "--json", ""], capsys)
    assert line.startswith("python -m kvpool.bench: error: argument --torch-threads")


@pytest.mark.parametrize("argv,says", [
    (["--json", "."], "is a directory"),
    (["--json", "same.out", "--plot", "same.out"], "both name"),
    (["--out", "{file}/sub"], "cannot write"),
])
def test_an_output_that_cannot_be_written_is_a_usage_error_and_nothing_is_written(tmp_path, capsys, argv, says):
    (tmp_path / "file").write_text("not a folder")
    argv = [a.replace("{file}", str(tmp_path / "file")) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path)]
    line = _usage_error(["churn", "--quick", "--allocators", "kvpool", *argv], capsys)
    assert says in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_quick_keeps_the_flags_given_explicitly(tmp_path):
    assert main(["churn", "--quick", "--allocators", "kvpool", "--page-sizes", "16", "--pool-sizes", "128K",
                 "--concurrency", "8", "--steps", "5", "--warmup", "2", "--out", str(tmp_path), "--plot", ""]) == 0
    doc = json.loads((tmp_path / "churn.json").read_text())
    assert (doc["settings"]["pool_sizes"], doc["settings"]["concurrency"]) == ([128 << 10], [8])
    assert (doc["settings"]["ref_pool"], doc["settings"]["ref_concurrency"]) == (128 << 10, 8)
    assert [(r["num_slots"], r["concurrency"], r["steps"]) for r in doc["results"]] == [(128 << 10, 8, 5)]
    assert doc["ratios"]["ref_pool"] == 128 << 10


def test_route_quick_keeps_explicit_steps_and_lanes(tmp_path):
    pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
    main(["route", "--quick", "--steps", "7", "--lanes", "3", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "route.json").read_text())
    assert (doc["settings"]["steps"], doc["settings"]["lanes"]) == (7, 3)


def test_a_budget_no_request_fits_writes_strict_json(tmp_path, capsys):
    """All-full pools of 1 MiB hold no 4K-token request: its bytes per request is undefined,
    which the JSON says with null (NaN is not JSON)."""
    assert main(["hybrid-memory", "--context", "4K", "--chunk", "1024", "--layers", "4", "--full-every", "2",
                 "--kv-heads", "1", "--head-dim", "64", "--window", "256", "--budgets", "1M",
                 "--max-requests", "8", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "hybrid-memory.json").read_text()
    doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    row = doc["budgets"][0]
    assert row["all_full"]["requests"] == 0 and row["all_full"]["bytes_per_request"] is None
    assert row["bytes_ratio"] is None
    # The table said 'nan' there, and the target read MISSES because nan <= 0.25 is false, though
    # the one-request ratio met it and nothing was measured at that budget.
    out = capsys.readouterr().out
    assert "nan" not in out and "none fits" in out and "n/a" in out
    assert doc["meets_target"] is (doc["per_request"]["ratio"] <= doc["target_ratio"])
    assert ("meets target" if doc["meets_target"] else "MISSES target") in out
