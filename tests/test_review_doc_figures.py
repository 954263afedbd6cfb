"""Figures the docs state about this repository's own files and code, each checked against
what they count, so that a change to the counted thing fails here rather than leaving the
doc behind (an outside-style docs sweep found these stale)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_reliability_md_counts_the_committed_fuzz_seeds():
    """docs/reliability.md said fuzz/seeds/ops held 206 files and the seeds about 90 KB after
    148 more ops inputs were committed (354 files, about 100 KB)."""
    text = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    m = re.search(r"`fuzz/seeds/ops`: (\d+) files, `fuzz/seeds/groups`: (\d+), about (\d+) KB", text)
    assert m, "docs/reliability.md no longer states the seed counts in the form this test reads"
    ops, groups, kb = (int(g) for g in m.groups())
    seeds = ROOT / "fuzz" / "seeds"
    files = {d: [f for f in (seeds / d).iterdir() if f.is_file()] for d in ("ops", "groups")}
    assert ops == len(files["ops"])
    assert groups == len(files["groups"])
    total = sum(f.stat().st_size for fs in files.values() for f in fs)
    assert abs(total / 1000 - kb) <= 0.15 * kb, (total, kb)
