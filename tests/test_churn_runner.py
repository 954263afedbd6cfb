"""One short churn replay per installed allocator: same work, tables right, everything freed.

kvpool always runs; SGLang's and vLLM's allocators run when their packages are
installed (``drivers.load`` reports the ones that are not, tested below with a
simulated import failure).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvpool.bench import drivers
from kvpool.bench.churn import CHURN
from kvpool.bench.churn.trace import ChurnTraceConfig, generate
from kvpool.bench.runner import max_step_tokens
from kvpool.bench.trace import Dist


def _trace(page_size):
    return generate(ChurnTraceConfig(num_slots=1 << 16, concurrency=24, page_size=page_size, steps=40, warmup=6,
                                prompt=Dist(16, 700), output=Dist(4, 60), seed=3))


def _classes(page_size):
    classes, skipped = drivers.load("churn", drivers.names("churn"))
    names = [c.name for c in classes]
    assert names[0] == "kvpool"
    for line in skipped:
        print(line)  # shown with -s / -ra output: which baselines this run compared against
    return [c for c in classes if c.supports(page_size)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_every_allocator_hands_out_the_same_slots_and_ends_free(page_size):
    trace = _trace(page_size)
    results = [CHURN.replay(cls, trace) for cls in _classes(page_size)]
    assert results[0].allocator == "kvpool"
    for r in results:
        assert r.handed_slots == trace.total_slots, r.allocator
        assert r.timed_slots == sum(s.slots for s in trace.measured), r.allocator
        assert r.end_free_slots == r.capacity_slots == (trace.config.num_pages - 1) * page_size, r.allocator
        assert r.consistent
        assert r.steps == trace.config.steps and r.mean_us > 0 and r.p99_us >= r.p50_us > 0
        assert r.meta_bytes > 0
    assert len({r.handed_slots for r in results}) == 1


def test_kvpool_driver_checks_its_out_slots_where_no_timed_step_follows():
    """kvpool's run() returns the trace's slot count (extend(out=) returns the buffer), so the
    driver checks each untimed decode step's out= slots against the allocator and the table."""
    from kvpool.bench.drivers.kvpool_churn import KVPoolChurnDriver

    trace = _trace(16)
    d = KVPoolChurnDriver(trace.config, max_step_tokens(trace))
    for step in trace.steps[:3]:  # warmup steps: checked
        d.run(d.prepare(step))
    d.decode_slots[:] += 1  # as if the last decode had handed out other slots
    with pytest.raises(AssertionError, match="disagree with the table"):
        d.prepare(trace.steps[3])


@pytest.mark.parametrize("page_size", [1, 16])
def test_tables_list_distinct_live_slots_for_every_running_request(page_size):
    """Mid-trace, each driver's engine table maps every running request to slots nobody else holds."""
    trace = _trace(page_size)
    cfg = trace.config
    lanes, lens = trace.drain.release_lanes, trace.drain.release_lens  # running at the end
    assert len(lanes) > 0
    for cls in _classes(page_size):
        d = cls(cfg, max_step_tokens(trace))
        for step in trace.steps:
            d.run(d.prepare(step))
        held = [d.held_slots(int(lane), int(n)) for lane, n in zip(lanes, lens)]
        flat = np.concatenate(held)
        assert len(np.unique(flat)) == len(flat) == int(lens.sum()), cls.name
        assert flat.min() >= page_size and flat.max() < cfg.num_slots, cls.name  # page 0 never handed out
        for slots in held:  # pages are whole: a request's slot k sits at offset k % P of its page
            assert np.array_equal(slots % page_size, np.arange(len(slots)) % page_size), cls.name
        assert d.free_slots() == (cfg.usable_pages - int(((lens + page_size - 1) // page_size).sum())) * page_size


def test_missing_baseline_is_skipped_with_one_line(monkeypatch):
    from kvpool.bench.drivers import sglang_base  # here, not at collection: it imports sglang

    monkeypatch.setattr(sglang_base.SGLANG_ALLOCATORS, "error", "ModuleNotFoundError: No module named 'sglang'")
    classes, skipped = drivers.load("churn", ["kvpool", "sglang-token"])
    assert [c.name for c in classes] == ["kvpool"]
    assert len(skipped) == 1 and "\n" not in skipped[0] and skipped[0].startswith("skipping sglang-token")
    with pytest.raises(ValueError, match="unknown allocator"):
        drivers.load("churn", ["kvpool", "tcmalloc"])


def test_cli_ops_quick(tmp_path):
    from kvpool.bench.__main__ import main

    out = tmp_path / "ops.json"
    assert main(["ops", "--quick", "--batch-sizes", "1,8", "--page-sizes", "1,16", "--pool-size", "64K",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["op"] for r in rows} == {"open", "close", "extend-decode", "extend-prefill", "truncate"}
    assert len(rows) == 5 * 2 * 2 and all(r["mean_us"] > 0 for r in rows)


def test_cli_writes_under_cwd_or_out_never_into_the_package(tmp_path, monkeypatch):
    from kvpool.bench.__main__ import main

    monkeypatch.chdir(tmp_path)
    args = ["ops", "--quick", "--ops", "open", "--batch-sizes", "1", "--page-sizes", "1", "--pool-size", "64K"]
    assert main(args) == 0
    assert json.loads((tmp_path / "ops.json").read_text())["results"][0]["op"] == "open"
    assert main([*args, "--out", "sub/dir"]) == 0
    assert (tmp_path / "sub" / "dir" / "ops.json").exists()


def test_progress_bars_work_without_tqdm():
    """tqdm is optional: with `import tqdm` failing, the bench and demo bars are silent no-ops."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['tqdm'] = None\n"
        "from kvpool.progress import progress\n"
        "assert list(progress([1, 2], desc='x')) == [1, 2]\n"
        "with progress(total=3, desc='y') as bar:\n"
        "    bar.update(1); bar.set_postfix_str('z')\n"
        "import kvpool.bench.churn, kvpool.bench.ops, kvpool.bench.prefix, kvpool.demo.cli\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_timing_takes_the_clocks_own_cost_off_every_figure():
    from kvpool.bench.runner import Timing, clock_overhead

    # Samples as the timing loop takes them: each includes the clock calls'
    # cost (in these samples 100 ns of wall, 700 ns of thread CPU); a sample below it counts 0.
    t = Timing(np.array([1100, 2100, 3100, 50]), np.array([1700, 2700, 3700, 600]), items=8,
               overhead_ns=(100, 700))
    s = t.summary()
    assert s["mean_us"] == pytest.approx(6000 / 4 / 1e3)
    assert s["cpu_mean_us"] == pytest.approx(6000 / 4 / 1e3)
    assert s["max_us"] == pytest.approx(3.0)
    assert s["ns_per_item"] == pytest.approx(6000 / 8)
    wall, cpu = clock_overhead(51)
    assert wall > 0 and cpu >= 0
