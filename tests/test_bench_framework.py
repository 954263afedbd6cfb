"""The shared benchmark framework: registry, passes and repeats, stored JSON, CLI checks.

Every workload (``churn``, ``prefix``) runs through the same registry, runner,
report and plot; these tests hold the framework's promises: the registry names
the classes it claims, repeats alternate between cases, stored result files
load back unchanged for ``--reuse``, the CLI keeps its JSON fields, and a
misspelt allocator stops the command before anything runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvpool.bench import command, drivers
from kvpool.bench.churn import ChurnWorkload
from kvpool.bench.churn.result import ChurnDriver, ChurnResult
from kvpool.bench.cli import UsageError
from kvpool.bench.drivers.base import Driver, Requirement
from kvpool.bench.hybrid import HybridResult
from kvpool.bench.prefix import PREFIX
from kvpool.bench.prefix.result import PrefixDriver, PrefixResult
from kvpool.bench.report import NO_BASELINE
from kvpool.bench.trace import Dist

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
INTERFACE = {"churn": ChurnDriver, "prefix": PrefixDriver, "hybrid": PrefixDriver}
ROW = {"churn": ChurnResult, "prefix": PrefixResult, "hybrid": HybridResult}


def _stored(benchmark):
    """The stored result files of ``benchmark`` (what earlier runs of the CLI wrote)."""
    docs = [(p, json.loads(p.read_text())) for p in sorted(RESULTS.glob(f"{benchmark}*.json"))]
    return [(p, d) for p, d in docs if d.get("benchmark") == benchmark]


@pytest.mark.parametrize("workload", ["churn", "prefix", "hybrid"])
def test_registry_names_each_workloads_own_driver_classes(workload):
    classes = [drivers.driver_class(workload, n) for n in drivers.names(workload)]
    assert [c.name for c in classes] == drivers.names(workload)  # a row's allocator is its registry name
    assert all(issubclass(c, INTERFACE[workload]) for c in classes)
    assert len(set(classes)) == len(classes)
    assert drivers.names(workload)[0] == "kvpool"
    with pytest.raises(ValueError, match="unknown allocator"):
        drivers.driver_class(workload, "tcmalloc")


def test_a_failed_baseline_import_is_the_skip_reason_of_every_driver_built_on_it():
    base_needs, own_needs = Requirement("engine tables"), Requirement("engine cache")
    with base_needs.imports():
        import kvpool_bench_no_such_engine  # noqa: F401
    with own_needs.imports():
        import math  # noqa: F401  (imports fine)

    class EngineBase(Driver):
        requires = (base_needs,)

    class EngineCache(EngineBase):
        requires = (own_needs,)

        def prepare(self, step):
            return step

        def run(self, prep):
            return 0

    why = EngineCache.skip_reason()
    assert why is not None and "\n" not in why
    assert why.startswith("engine tables not importable (ModuleNotFoundError: No module named "
                          "'kvpool_bench_no_such_engine')")
    with pytest.raises(RuntimeError, match="engine tables not importable"):
        EngineCache(None)
    assert own_needs.skip_reason() is None


class _RecordingChurn(ChurnWorkload):
    """The churn workload, noting the order in which the runner replays (driver, trace)."""

    def __init__(self):
        self.calls = []

    def replay(self, driver_cls, trace):
        cfg = trace.config
        self.calls.append((driver_cls.name, cfg.num_slots, cfg.concurrency))
        return super().replay(driver_cls, trace)


def test_repeats_alternate_between_cases_and_the_median_keeps_every_mean():
    wl = _RecordingChurn()
    args = argparse.Namespace(pool_sizes=[1 << 14, 1 << 15], concurrency=[8, 16], page_sizes=[16], grid="full",
                              ref_pool=1 << 14, ref_concurrency=16, target_repeats=3, steps=12, warmup=4,
                              prompt=Dist(16, 300), output=Dist(4, 40), seed=1)
    cases = wl.cases(args)
    kv = drivers.driver_class("churn", "kvpool")
    results = command.run_cases(wl, cases, [kv])
    # Targets: the reference point and the largest pool at the reference concurrency.
    targets = [(1 << 14, 16), (1 << 15, 16)]
    order = [(1 << 14, 8), (1 << 14, 16), (1 << 15, 8), (1 << 15, 16)]
    assert [(p, c) for _, p, c in wl.calls] == order + targets + targets  # pass by pass, not back to back
    assert [(r.num_slots, r.concurrency) for r in results] == order  # one row per case, in case order
    for r in results:
        assert len(r.repeat_means_us) == (3 if (r.num_slots, r.concurrency) in targets else 1)
        assert r.mean_us == sorted(r.repeat_means_us)[(len(r.repeat_means_us) - 1) // 2]
        assert r.consistent


def test_prefix_repeats_only_kvpool():
    args = argparse.Namespace(scenarios=["system", "chat"], page_sizes=[1, 16], pool_sizes=[1 << 16],
                              concurrency=16, steps=10, warmup=5, seed=0, repeats=3, quick=False)
    cases = PREFIX.cases(args)
    assert len(cases) == 4
    assert all(c.repeats_of("kvpool") == 3 and c.repeats_of("vllm") == c.repeats_of("sglang") == 1 for c in cases)


@pytest.mark.parametrize("benchmark", ["churn", "prefix", "hybrid"])
def test_stored_rows_load_back_unchanged(benchmark):
    """--reuse reads rows of stored files: every stored row must come back as the same JSON."""
    stored = _stored(benchmark)
    assert stored, f"no stored {benchmark} results under {RESULTS}"
    for path, doc in stored:
        for row in doc["results"]:
            assert ROW[benchmark].from_json(row).to_json() == row, path.name


def test_reuse_takes_the_rows_of_other_allocators_and_refuses_other_traces():
    path, doc = next((p, d) for p, d in _stored("prefix") if p.name == "prefix-baselines.json")
    args = argparse.Namespace(out=str(RESULTS), reuse=path.name, **{k: doc["settings"][k] for k in
                                                                     PREFIX.reuse_settings})
    merged = command.with_reused(PREFIX, args, [])
    assert sorted(r.to_json()["allocator"] for r in merged) == sorted(r["allocator"] for r in doc["results"])
    assert [r.case for r in merged] == sorted(r.case for r in merged)
    ours = [r for r in merged if r.allocator == "vllm"]
    again = command.with_reused(PREFIX, args, ours)
    assert [r for r in again if r.allocator == "vllm"] == ours  # rows of a running allocator are not taken
    args.steps += 1
    with pytest.raises(UsageError, match="traces differ"):
        command.with_reused(PREFIX, args, [])


def _bad_reuse_files(tmp_path):
    """(name, contents) of files --reuse must refuse, each with the words its refusal says."""
    good = json.loads((RESULTS / "prefix.json").read_text())
    quick = dict(good["settings"], concurrency=16, steps=24, warmup=16, seed=0, quick=True)
    other = dict(good, benchmark="hybrid", settings=dict(quick, command="hybrid"))
    bad_row = dict(good, settings=quick, results=[dict(good["results"][0], scenario="no-such-scenario")])
    alien = dict(good, settings=quick, results=[dict(good["results"][0], allocator="sglang-token")])
    return [("corrupt.json", '{"settings": ', "cannot read"), ("list.json", "[1, 2]", "not a results file"),
            ("other.json", json.dumps(other), "a 'hybrid' run's file"),
            ("steps.json", json.dumps(dict(good, settings=dict(quick, steps=25))), "steps: 25 there, 24 here"),
            ("row.json", json.dumps(bad_row), "results[0] is not a prefix row"),
            ("alien.json", json.dumps(alien), "allocator 'sglang-token'"),
            ("nan.json", json.dumps(dict(good, settings=quick)).replace('"allocator"', '"x": NaN, "allocator"', 1),
             "NaN is not JSON")]


def test_reuse_refuses_a_file_it_cannot_take_before_anything_runs(tmp_path, capsys):
    """A corrupt file, another command's file, other trace settings or a row of another workload:
    a usage error naming --reuse (exit 2) before any replay, and nothing written; it was a
    JSONDecodeError traceback or a SystemExit after the whole run, and another workload's file
    with equal settings joined its rows to the table."""
    from kvpool.bench.__main__ import main

    for name, text, words in _bad_reuse_files(tmp_path):
        (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit) as e:
            main(["prefix", "--quick", "--scenarios", "system", "--page-sizes", "16", "--out", str(tmp_path),
                  "--plot", "", "--reuse", name])
        assert e.value.code == 2, name
        err = capsys.readouterr().err
        assert f"--reuse {name}" in err and words in err, (name, err)
        assert "prefix:   0%" not in err  # refused before the first replay started
        assert not (tmp_path / "prefix.json").exists()


@pytest.mark.parametrize("benchmark,reference,argv,printed", [
    # kvpool alone: each ratio block says it has no baseline (its header stood over nothing)
    ("churn", "churn-reference.json", ["--allocators", "kvpool", "--page-sizes", "16"],
     ["| page | pool |", f"(target >= 10x):\n{NO_BASELINE}\n"]),
    ("prefix", "prefix.json", ["--allocators", "kvpool", "--scenarios", "system,parallel"],
     ["| scenario | page | pool |", "Hit-rate parity", f"%):\n{NO_BASELINE}\n", f"tokens):\n{NO_BASELINE}\n"]),
    ("hybrid", "hybrid.json", ["--allocators", "kvpool", "--scenarios", "system,chat"],
     ["| scenario | page | pool | window |", f"(target >=):\n{NO_BASELINE}\n", f"10x):\n{NO_BASELINE}\n"]),
])
def test_cli_quick_writes_table_json_and_plot_with_the_fields_of_the_stored_results(tmp_path, capsys, benchmark,
                                                                                    reference, argv, printed):
    from kvpool.bench.__main__ import main

    out_json, out_png = tmp_path / f"{benchmark}.json", tmp_path / f"{benchmark}.png"
    assert main([benchmark, "--quick", *argv, "--json", str(out_json), "--plot", str(out_png)]) == 0
    doc = json.loads(out_json.read_text())
    rows = doc["results"]
    assert rows and {r["allocator"] for r in rows} == {"kvpool"} and all(r["consistent"] for r in rows)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert all(text in out for text in printed)
    # The same fields as the stored results of this command, which --reuse and readers rely on.
    ref = json.loads((RESULTS / reference).read_text())
    assert set(doc) == set(ref)
    assert set(doc["settings"]) == set(ref["settings"])
    assert set(doc["ratios"]) == set(ref["ratios"])
    assert {frozenset(r) for r in rows} == {frozenset(ref["results"][0])}
    if benchmark == "prefix":
        assert {(r["scenario"], r["page_size"]) for r in rows} == {(s, p) for s in ("system", "parallel")
                                                                   for p in (1, 16)}
        assert all(r["total_hit_tokens"] > 0 for r in rows)
    if benchmark == "hybrid":
        assert {(r["scenario"], r["page_size"]) for r in rows} == {("system", 16), ("chat", 16)}
        assert all(r["total_hit_tokens"] > 0 and r["full_pages"] + r["sliding_pages"] == r["num_slots"] // 16
                   for r in rows)


@pytest.mark.parametrize("benchmark,flag,value", [("churn", "--allocators", "kvpool,sglang"),
                                                  ("prefix", "--allocators", "kvpool,vllm-blockpool"),
                                                  ("prefix", "--scenarios", "system,agents"),
                                                  ("hybrid", "--allocators", "kvpool,sglang")])
def test_a_misspelt_name_is_a_usage_error_that_lists_the_choices(benchmark, flag, value, capsys):
    from kvpool.bench.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main([benchmark, "--quick", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown" in err and "choose from" in err and value.split(",")[1] in err



def test_machine_records_whether_the_checkout_differs_from_its_commit(tmp_path):
    """git_commit alone named HEAD for a run with uncommitted edits, as if the commit had run."""
    import subprocess

    from kvpool.bench import report

    def git(*argv):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *argv], cwd=tmp_path, check=True,
                       capture_output=True)

    assert report._git_commit(str(tmp_path)) is None and report._git_dirty(str(tmp_path)) is None
    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("commit", "-q", "-m", "x")
    assert report._git_commit(str(tmp_path)) and report._git_dirty(str(tmp_path)) is False
    (tmp_path / "f.py").write_text("a = 2\n")
    assert report._git_dirty(str(tmp_path)) is True
    assert set(report.machine_info()) >= {"git_commit", "git_dirty", "versions", "torch_threads"}


def test_table_ratio_under_one_keeps_two_significant_digits():
    """A row 50x faster than kvpool's on the same trace printed '0.0x' in the '÷ kvpool' column."""
    from kvpool.bench import report

    doc = json.loads((RESULTS / "prefix.json").read_text())
    kv = PrefixResult.from_json(next(r for r in doc["results"] if r["allocator"] == "kvpool"))
    other = PrefixResult.from_json(dict(kv.to_json(), allocator="kvpool-host", mean_us=kv.mean_us / 50))
    slow = PrefixResult.from_json(dict(kv.to_json(), allocator="vllm", mean_us=kv.mean_us * 6.25))
    text = report.table([kv, other, slow], PREFIX.columns, PREFIX.versus_kvpool)
    assert "| 0.02x |" in text and "| 6.2x |" in text and "0.0x" not in text
