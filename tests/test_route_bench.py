"""python -m kvpool.bench route / events: quick runs (seconds) that must hold
their own checks; the full runs' figures are in benchmarks/results."""

import json

import pytest

pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")


def test_route_quick_beats_round_robin_and_agrees(tmp_path, capsys):
    from kvpool.bench.__main__ import main

    assert main(["route", "--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "route.json").read_text())
    routed, rr = doc["results"]
    assert (routed["policy"], rr["policy"]) == ("router", "round-robin")
    assert routed["prompt_tokens"] == rr["prompt_tokens"] > 0, "the same workload for both"
    assert routed["hit_rate"] > rr["hit_rate"] and doc["hit_rate_factor"] > 1
    assert routed["agreement"] >= 0.999 and routed["requests"] > 50
    assert routed["route_us"]["mean"] > 0
    assert "agreement" in capsys.readouterr().out


def test_route_without_round_robin_hits_says_n_a_not_inf(tmp_path, capsys):
    """Parallel traces share nothing across groups: neither policy hits, and the line read 'hit rate
    xinf' (0 / 0), the JSON null, with no word of why."""
    from kvpool.bench.__main__ import main

    assert main(["route", "--quick", "--scenario", "parallel", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "route.json").read_text())
    assert doc["results"][1]["hit_rate"] == 0 and doc["hit_rate_factor"] is None
    out = capsys.readouterr().out
    assert "inf" not in out.replace("info", "") and "nan" not in out
    assert "hit rate n/a (round-robin hit nothing; the router 0.0%)" in out


def test_events_bench_reports_every_size(tmp_path):
    pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
    from kvpool.bench.__main__ import main

    assert main(["events", "--sizes", "10,100", "--repeats", "5", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "events.json").read_text())["results"]
    assert [r["events"] for r in rows] == [10, 100] and all(r["payload_bytes"] > 0 for r in rows)


def test_events_bench_at_page_size_1_publishes_every_event(tmp_path):
    """At page size 1 a request's first token is its first page: requests must not share one."""
    pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
    from kvpool.bench.__main__ import main

    assert main(["events", "--sizes", "1000", "--page-size", "1", "--repeats", "20", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "events.json").read_text())["results"]
    assert [r["events"] for r in rows] == [1000]
