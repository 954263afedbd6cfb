"""Ratios and tables of the churn report, on hand-made results."""

from __future__ import annotations

from kvpool.bench import columns, report
from kvpool.bench.churn import CHURN, figures
from kvpool.bench.churn.result import ChurnResult
from kvpool.bench.result import median_run


def _r(allocator, page, pool, conc, mean, p50=None, cpu=None):
    return ChurnResult(
        allocator=allocator, label=allocator, version="", page_size=page, num_slots=pool, concurrency=conc,
        steps=10, mean_batch=float(conc), mean_us=mean, cpu_mean_us=cpu or mean, p50_us=p50 or mean,
        p99_us=2 * mean, max_us=3 * mean, ns_per_slot=1.0, timed_slots=10, meta_bytes=2**20,
        python_bytes=0, native_bytes=2**20, handed_slots=5, expected_slots=5, end_free_slots=7,
        capacity_slots=7,
    )


M = 1 << 20


def test_ratios_divide_each_baseline_by_kvpool_at_the_reference_point_only():
    results = [
        _r("kvpool", 1, M, 256, 10.0, p50=5.0), _r("sglang-token", 1, M, 256, 150.0, p50=10.0),
        _r("kvpool", 1, 16 * M, 256, 10.5), _r("sglang-token", 1, 16 * M, 256, 9999.0),
        _r("kvpool", 16, M, 256, 4.0), _r("vllm-blockpool", 16, M, 256, 36.0),
        _r("kvpool", 16, 16 * M, 256, 5.0), _r("kvpool", 16, M, 64, 1.0), _r("vllm-blockpool", 16, M, 64, 50.0),
    ]
    ratios = figures.churn_ratios(results, M, 256)
    base = ratios["baseline_over_kvpool"]
    assert set(base) == {"sglang-token page 1", "vllm-blockpool page 16"}
    assert base["sglang-token page 1"] == {"mean": 15.0, "p50": 2.0, "cpu_mean": 15.0, "meets_target": True}
    assert base["vllm-blockpool page 16"]["mean"] == 9.0 and not base["vllm-blockpool page 16"]["meets_target"]
    scaling = ratios["kvpool_scaling"]
    assert scaling["page 1 16M/1M"]["mean"] == 1.05 and scaling["page 1 16M/1M"]["meets_target"]
    assert scaling["page 16 16M/1M"]["mean"] == 1.25 and not scaling["page 16 16M/1M"]["meets_target"]
    text = figures.ratio_lines(ratios)
    assert "MISSES" in text and "meets" in text


def test_table_has_one_row_per_result_and_ratio_columns_for_baselines():
    results = [_r("kvpool", 16, M, 256, 4.0), _r("sglang-paged", 16, M, 256, 200.0)]
    lines = report.table(results, CHURN.columns, CHURN.versus_kvpool).splitlines()
    assert len(lines) == 2 + len(results)
    assert lines[2].endswith("|  |  |")  # kvpool row: no ratio against itself
    assert "| 50.0x | 50.0x |" in lines[3]
    assert columns.size(M) == "1M" and columns.size(64 << 10) == "64K" and columns.size(1000) == "1000"


def test_median_run_keeps_the_middle_repeat_and_every_mean():
    runs = [_r("kvpool", 1, M, 256, m) for m in (9.0, 3.0, 5.0)]
    chosen = median_run(runs)
    assert chosen.mean_us == 5.0 and chosen.repeat_means_us == [9.0, 3.0, 5.0] and chosen.consistent
    runs = [_r("kvpool", 1, M, 256, m) for m in (1.0, 2.0)]
    runs[1].end_free_slots -= 1  # one repeat leaked a slot: the reported run must say so
    assert median_run(runs).mean_us == 1.0 and not median_run(runs).consistent
