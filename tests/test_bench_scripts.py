"""benchmarks/soak.py and benchmarks/gpu_check.py: a bad flag or an output path that cannot be
written is a usage error (exit 2) before a run of minutes, not a traceback after it."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module


def _usage_error(main, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,says", [
    (["--minutes", "0"], "--minutes"),
    (["--minutes", "nan"], "--minutes"),
    (["--minutes", "0.01", "--threads", "0"], "--threads"),
    (["--minutes", "0.01", "--sample-s", "0"], "--sample-s"),
    (["--minutes", "0.01", "--warmup-frac", "1"], "--warmup-frac"),
    (["--minutes", "0.01", "--json", "{tmp}"], "is a directory"),
])
def test_soak_rejects_bad_flags_before_it_runs(script, tmp_path, capsys, argv, says):
    soak = script("soak")
    line = _usage_error(soak.main, [a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert says in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,says", [
    (["--only", "bandwdith"], "bandwdith"),
    (["--budget-s", "0"], "--budget-s"),
    (["--peak-gbps", "-1"], "--peak-gbps"),
    (["--out", "{tmp}"], "is a directory"),
    (["--out", "{tmp}/file/gpu_check.json"], "cannot write"),
])
def test_gpu_check_rejects_bad_flags_before_it_runs(script, tmp_path, capsys, argv, says):
    gpu_check = script("gpu_check")
    (tmp_path / "file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "gpu_check.json")]
    line = _usage_error(gpu_check.main, ["--device", "cpu", *argv], capsys)
    assert says in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_gpu_check_dry_run_of_one_section_writes_strict_json(script, tmp_path):
    gpu_check = script("gpu_check")
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--only", "shared_pages", "--out", str(out)]) == 0
    doc = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert doc["shared_pages"]["ok"] is True and set(doc["seconds"]) == {"shared_pages"}
    assert doc["summary"]["errors"] == []


def test_gpu_check_exits_1_and_names_a_section_that_raised(script, tmp_path, monkeypatch):
    # A raised section has no ok flag: without this, a GPU session read the run as ok.
    gpu_check = script("gpu_check")
    import gpu_correctness

    def broken():
        raise RuntimeError("index_cpu not implemented for Float8_e4m3fn")

    monkeypatch.setattr(gpu_correctness, "section_shared_pages", broken)
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--only", "shared_pages", "--out", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert doc["summary"]["errors"] == ["shared_pages"]
    assert "index_cpu not implemented" in doc["shared_pages"]["error"]


@pytest.mark.parametrize("argv,says", [
    (["--page-sizes", "1,3"], "--num-slots 1048576 is not a whole number of pages of 3 slots"),
    (["--steps", "0"], "--steps"),
    (["--page-sizes", "x"], "--page-sizes"),
])
def test_prefix_split_rejects_bad_flags_before_the_first_run(script, capsys, argv, says):
    line = _usage_error(script("prefix_split").main, argv, capsys)
    assert says in line and "page 1:" not in capsys.readouterr().out


def test_prefix_split_prints_a_run_that_admits_nothing_in_its_measured_steps(script, capsys):
    script("prefix_split").main(["--num-slots", "64K", "--steps", "5", "--warmup", "2", "--page-sizes", "16"])
    out = capsys.readouterr().out
    assert out.startswith("system page 16: ") and "0 prompt and 0 hit tokens per step" in out


def test_prefix_split_times_a_closing_requests_registration_apart_from_its_release(script, capsys):
    argv = ["--num-slots", "64K", "--steps", "30", "--warmup", "20", "--page-sizes", "1", "--scenario", "chat"]
    script("prefix_split").main(argv + ["--split-close"])
    apart = capsys.readouterr().out
    script("prefix_split").main(argv)
    whole = capsys.readouterr().out
    assert "close: cache " in apart and "close: release " in apart and "close " not in apart.replace("close: ", "")
    assert "close " in whole and "close: " not in whole


def test_prefix_split_can_register_each_decode_steps_pages_at_decode(script, capsys):
    argv = ["--num-slots", "64K", "--steps", "30", "--warmup", "20", "--page-sizes", "1", "--scenario", "chat",
            "--split-close"]
    def calls(extra: list[str]) -> dict[str, float]:
        script("prefix_split").main(argv + extra)
        out = capsys.readouterr().out
        return {k: float(v) for k, v in (c.rsplit(" ", 1) for c in out[out.index("(") + 1:out.index(")")].split(", "))}

    at_decode, at_close = calls(["--cache-at-decode"]), calls([])
    assert "decode cache" not in at_close and at_decode["decode cache"] > 0
    # Every output page was registered at its decode step, so a closing request has none left.
    assert at_decode.get("close: cache", 0.0) < at_decode["decode cache"]


@pytest.mark.parametrize("argv,says", [(["--steps", "0"], "--steps"), (["--slots", "x"], "--slots"),
                                       (["--slots", "1000", "--page-size", "16"], "--slots 1000")])
def test_prefix_call_times_rejects_bad_flags_before_it_runs(script, capsys, argv, says):
    line = _usage_error(script("prefix_call_times").main, argv, capsys)
    assert says in line and "calls" not in capsys.readouterr().out


def test_prefix_call_times_times_every_call_of_a_short_replay(script, capsys):
    script("prefix_call_times").main(["--slots", "64K", "--steps", "40", "--scenario", "chat"])
    out = capsys.readouterr().out
    assert out.startswith("chat, 65536 slots, page 1, 40 steps, ") and "  cache(): max " in out


K = 1 << 10
CI_SOAK = [4242268] * 9 + [4247676, 4247548, 4247420, 4247420, 4247372, 4247292, 4247164] + [4247980] * 7


@pytest.mark.parametrize("values,leak", [
    ([4000 * K] * 12, False),
    ([4000 * K] * 5 + [4200 * K] * 7, False),  # one step to a new high-water mark (a hash map doubling)
    ([4000 * K, 3990 * K, 4000 * K, 3995 * K] + [4200 * K] * 8, False),
    # A hash map's capacity() drifting down with tombstones and back up on a rehash in
    # place, after one step: the samples of a CI soak that failed on it.
    (CI_SOAK, False),
    ([4000 * K] * 4 + [4100 * K] * 4 + [4200 * K] * 4, True),  # a climb through every third
    ([4000 * K + 20 * K * i for i in range(12)], True),
])
def test_soak_calls_a_climb_of_metadata_a_leak_and_one_step_not(script, values, leak):
    got = script("soak").metadata_climb(values)
    assert (got is not None) == leak, got


def test_hf_split_rejects_zero_rounds(script, capsys):
    assert "--rounds" in _usage_error(script("hf_split").main, ["--rounds", "0"], capsys)


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--generates", "0"], ["--cache", "static"],
                                  ["--scope", "prefill"]])
def test_hf_instructions_rejects_bad_flags_before_it_runs(script, capsys, argv):
    assert argv[0] in _usage_error(script("hf_instructions").main, argv, capsys)


@pytest.mark.parametrize("scope", ["update", "generate"])
@pytest.mark.parametrize("cache", ["kvpool", "dynamic"])
def test_hf_instructions_counted_calls_run_outside_valgrind(script, cache, scope):
    # What callgrind counts, run bare (no toggle library): both caches decode a batch, through
    # the cache's calls alone or through whole generates.
    pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
    __import__("_hf_skip").require_hf()  # transformers may refuse this torch
    script("hf_instructions").child(2, cache, 1, "-", scope)


@pytest.mark.parametrize("argv,says", [
    (["--heads", "3"], "--heads 3"),
    (["--batches", "1,x"], "--batches"),
    (["--prompt-len", "4000", "--new-tokens", "200"], "4096 positions"),
    (["--out", "{tmp}"], "is a directory"),
])
def test_bench_hf_rejects_bad_flags_before_it_runs(script, tmp_path, capsys, argv, says):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "hf.json")]
    assert says in _usage_error(script("bench_hf").main, argv, capsys)
    assert list(tmp_path.iterdir()) == []


def test_bench_allocator_names_its_ratio_by_the_sizes_it_ran(script, tmp_path, capsys):
    out = tmp_path / "allocator.json"
    script("bench_allocator").main(["--quick", "--sizes", "64K,256K", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"64K", "256K"} and "256K/64K within 10%" in doc["targets"]
    printed = capsys.readouterr().out
    assert "target 256K/64K within 10%" in printed and "16M" not in printed
    assert set(doc["ratios"]) == {line.split("  ")[0] for line in printed.splitlines()[2:8]}


def test_bench_allocator_ratio_is_largest_over_smallest_in_any_order_and_the_json_says_what_ran(script, tmp_path,
                                                                                                 capsys):
    """--sizes 256K,64K gave a 64K/256K ratio (under 1: the scaling target met however slow the large
    pool), and the JSON recorded neither the flags nor kvpool's commit."""
    out = tmp_path / "allocator.json"
    script("bench_allocator").main(["--quick", "--sizes", "256K,64K", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert list(doc["results"]) == ["64K", "256K"] and "256K/64K within 10%" in doc["targets"]
    assert "target 256K/64K within 10%" in capsys.readouterr().out
    assert doc["settings"] == {"sizes": [64 << 10, 256 << 10], "quick": True, "out": str(out)}
    assert {"git_commit", "git_dirty", "versions"} <= set(doc["host"])


@pytest.mark.parametrize("argv,says", [(["--sizes", "64K,64K"], "twice"), (["--sizes", "64Q"], "--sizes"),
                                       (["--out", "{tmp}"], "is a directory")])
def test_bench_allocator_rejects_bad_flags_before_it_runs(script, tmp_path, capsys, argv, says):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert says in _usage_error(script("bench_allocator").main, ["--quick", *argv], capsys)
    assert list(tmp_path.iterdir()) == []


def test_bench_pool_json_records_its_flags_and_the_commit_that_ran(script, tmp_path):
    """The JSON held torch's version and the CPU count only: not --steps / --rounds / --seed, nor kvpool's commit."""
    out = tmp_path / "pool.json"
    script("bench_pool").main(["--steps", "3", "--rounds", "2", "--seed", "5", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["settings"] == {"steps": 3, "rounds": 2, "seed": 5, "out": str(out)}
    assert doc["machine"]["torch_threads"] == 1 and {"git_commit", "git_dirty", "versions"} <= set(doc["machine"])


@pytest.mark.parametrize("argv,says", [(["--steps", "0"], "--steps"), (["--rounds", "-1"], "--rounds"),
                                       (["--out", "{tmp}"], "is a directory")])
def test_bench_pool_rejects_bad_flags_before_it_runs(script, tmp_path, capsys, argv, says):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert says in _usage_error(script("bench_pool").main, argv, capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,expected", [
    ([], ["churn", "--out", "{R}"]),
    (["--quick"], ["churn", "--out", "{R}", "--quick"]),
    (["hybrid", "--quick"], ["hybrid", "--out", "{R}", "--quick"]),
    (["--torch-threads", "2", "route"], ["--torch-threads", "2", "route", "--out", "{R}"]),
    (["hybrid-memory", "--out", "x"], ["hybrid-memory", "--out", "x"]),
    (["prefix", "--out=x"], ["prefix", "--out=x"]),
])
def test_churn_script_takes_every_bench_command_and_writes_to_the_results_folder(script, argv, expected):
    """benchmarks/churn.py takes the arguments of python -m kvpool.bench (docs/benchmarks.md), any
    command, and writes under benchmarks/results unless --out says otherwise."""
    churn = script("churn")
    assert churn.bench_argv(argv) == [a.replace("{R}", str(churn.RESULTS)) for a in expected]


@pytest.mark.parametrize("argv,says", [(["--only", "env,shapez"], "shapez"), (["--total-s", "0"], "--total-s"),
                                       (["--out", "{tmp}/file"], "is a file")])
def test_gpu_session_rejects_bad_flags_before_it_runs(script, tmp_path, capsys, argv, says):
    (tmp_path / "file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "session")]
    assert says in _usage_error(script("gpu_session").main, ["--device", "cpu", "--list", *argv], capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_gpu_session_only_takes_a_section_prefix(script, tmp_path, capsys):
    assert script("gpu_session").main(["--device", "cpu", "--list", "--only", "cuda_tests",
                                       "--out", str(tmp_path)]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed and all(name.startswith("cuda_tests:") for name in listed)


def test_prefix_replay_makes_the_recorded_calls_and_times_them_per_step(script, tmp_path):
    replay = script("prefix_replay")
    rec = replay.record("chat", 1, 30, 10, 1 << 16, True)
    per = replay.replay(rec)
    # Each measured call name is timed, and the total is their sum.
    assert {"open_with_prefix", "extend", "cache", "close", "decode extend"} <= set(per)
    calls = {k: v for k, v in per.items() if k not in ("total", "take_events (apart)")}
    assert per["total"] == pytest.approx(sum(calls.values()))
    assert per["take_events (apart)"] > 0  # events on: the drains are timed, apart
    # A second replay on a fresh allocator sees the same handles (it would stop otherwise).
    assert set(replay.replay(rec)) == set(per)


def test_prefix_replay_stops_where_a_build_hands_out_other_rows(script):
    replay = script("prefix_replay")
    rec = replay.record("system", 16, 5, 2, 1 << 16, False)
    i = next(i for i, c in enumerate(rec["calls"]) if c[0] == "open_with_prefix")
    name, args, kw, measured, handles = rec["calls"][i]
    rec["calls"][i] = (name, args, kw, measured, handles + 1)
    with pytest.raises(SystemExit, match="other handles"):
        replay.replay(rec)


def test_prefix_replay_ab_alternates_two_builds_and_writes_ratios(script, tmp_path, capsys):
    replay = script("prefix_replay")
    calls, out = tmp_path / "calls.pkl", tmp_path / "ab.json"
    replay.main(["record", str(calls), "--scenario", "pressure", "--steps", "8", "--warmup", "2",
                 "--num-slots", "64K"])
    import kvpool

    build = str(Path(kvpool.__file__).resolve().parent.parent)  # where this run imports it from
    replay.main(["ab", str(calls), build, build, "--rounds", "1", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["rounds"] == 1 and res["median_us"]["a"]["total"] > 0
    assert set(res["ratio_b_over_a"]) == set(res["median_us"]["b"])
    assert "B/A" in capsys.readouterr().out


@pytest.mark.parametrize("argv,says", [
    # a traceback (ValueError) before: the trace config's complaint, now naming this script's flags
    (["record", "{tmp}/c.pkl", "--num-slots", "1000", "--page-size", "16"], "--num-slots 1000 is not a whole"),
    # a FileNotFoundError after the whole recording before
    (["record", "{tmp}/no/c.pkl", "--num-slots", "64K"], "is not a writable directory"),
    (["record", "{tmp}", "--num-slots", "64K"], "is a directory"),
    # a CalledProcessError traceback from the first round before
    (["ab", "{tmp}/none.pkl", "{build}", "{build}"], "is no file"),
    # ran, and timed whatever kvpool the child process found (an installed one) as this build
    (["ab", "{tmp}/c.pkl", "{tmp}", "{build}"], "holds no kvpool package"),
    (["ab", "{tmp}/c.pkl", "{build}", "{build}", "--json", "{tmp}/no/ab.json"], "not a writable directory"),
])
def test_prefix_replay_rejects_bad_arguments_before_it_records_or_replays(script, tmp_path, capsys, argv, says):
    import kvpool

    build = str(Path(kvpool.__file__).resolve().parent.parent)
    (tmp_path / "c.pkl").write_bytes(b"")
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{build}", build) for a in argv]
    line = _usage_error(script("prefix_replay").main, argv, capsys)
    assert says in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pkl"]


def test_prefix_replay_ab_names_the_build_whose_replay_failed(script, tmp_path):
    """A build whose replay fails is a one-line exit naming it, not a CalledProcessError traceback."""
    import kvpool

    build = str(Path(kvpool.__file__).resolve().parent.parent)
    (tmp_path / "c.pkl").write_bytes(b"not a pickle")
    with pytest.raises(SystemExit, match=f"the replay with build {build} failed"):
        script("prefix_replay").main(["ab", str(tmp_path / "c.pkl"), build, build, "--rounds", "1"])


def test_prefix_replay_build_check_ignores_a_kvpool_in_the_working_directory(script, tmp_path, monkeypatch):
    """The build check ran ``python -c`` in the caller's working directory, which comes first on its
    sys.path: run from a folder holding a kvpool package (a checkout's python/), it found that one
    and refused every other build, though the replay itself (a script) never looks there."""
    import kvpool

    build = str(Path(kvpool.__file__).resolve().parent.parent)
    (tmp_path / "kvpool").mkdir()
    (tmp_path / "kvpool" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert script("prefix_replay").build_problem(build) is None


def _cuda_host_paths(*argv: str) -> subprocess.CompletedProcess:
    """benchmarks/cuda_host_paths.py in a child: TRITON_INTERPRET must be set before kvpool's
    kernels are imported, which this session has done. The child imports the kvpool this session
    did (an installed one in CI, where the checkout's python/ has no built extension)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([p for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(BENCH / "cuda_host_paths.py"), *argv], env=env,
                          capture_output=True, text=True, timeout=300)


def test_cuda_host_paths_times_the_pools_own_paths_against_the_generic_ones(tmp_path):
    """Every write row holds the three figures and their ratio; every table row its two."""
    out = tmp_path / "w.json"
    proc = _cuda_host_paths("--rows", "1,3", "--rounds", "1", "--number", "20", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert set(got["write"]) == {"token x1", "token x3", "paged x1", "paged x3"}
    for fig in got["write"].values():
        assert all(fig[k] > 0 for k in ("pool_us", "generic_us", "bare_us", "pool_over_generic")), fig
    assert set(got["table"]) == {"extend x1", "extend x3"}
    for fig in got["table"].values():
        assert all(fig[k] > 0 for k in ("kept_us", "views_us", "kept_over_views")), fig


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--rows", "1,x"], ["--rounds", "0"], ["--number", "-3"],
                                  ["--sections", "write,read"]])
def test_cuda_host_paths_rejects_bad_flags_before_it_runs(argv):
    proc = _cuda_host_paths(*argv)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
