"""Where `generate` with `KVPoolCache` spends host time that `DynamicCache` does not: a
cProfile of whole `generate` calls for each cache (alternated, after a warm-up), and the
functions whose own time differs most, per new token.

    PYTHONPATH=python:benchmarks python benchmarks/hf_profile_diff.py --batch 8 --device cuda

hf_split.py times the cache's own calls (`update` and its parts); this looks at everything
else too (mask building, `get_seq_length`, the attention function, tensor ops), which is
where a gap "not in the cache's own calls" has to be. cProfile inflates every Python call,
so read the differences, not the absolute figures.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from pathlib import Path
from typing import Any

from kvpool.bench.cli import count


def _where(key: tuple[str, int, str]) -> str:
    file, line, func = key
    return func if file == "~" else f"{'/'.join(file.split('/')[-2:])}:{line}({func})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=count(1), default=8)
    ap.add_argument("--rounds", type=count(1), default=3)
    ap.add_argument("--new-tokens", type=count(1), default=64)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--top", type=count(1), default=30)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = ap.parse_args(argv)

    import torch

    from kvpool.bench.hf_generate import HFSettings, build_model, run_once
    from kvpool.integrations.transformers import KVPoolCache, pool_for_model

    torch.set_num_threads(1)
    from transformers import DynamicCache

    s = HFSettings(batches=(a.batch,), new_tokens=a.new_tokens, device=a.device)
    model = build_model(s)
    per_row = -(-(s.prompt_len + s.new_tokens) // s.page_size) * s.page_size
    pool = pool_for_model(model, max_tokens=a.batch * per_row + 64, page_size=s.page_size,
                          max_requests=a.batch, max_context_len=s.prompt_len + s.new_tokens)
    g = torch.Generator().manual_seed(s.seed)
    ids = torch.randint(3, s.vocab, (a.batch, s.prompt_len), generator=g).to(a.device)

    def generate(kind: str) -> None:
        if kind == "dynamic":
            run_once(model, ids, DynamicCache(config=model.config), s.new_tokens)
        else:
            with KVPoolCache(pool) as cache:
                run_once(model, ids, cache, s.new_tokens)

    profs = {"dynamic": cProfile.Profile(), "kvpool": cProfile.Profile()}
    for r in range(a.rounds + 1):  # round 0 warms up, unprofiled
        for kind in (("dynamic", "kvpool") if r % 2 == 0 else ("kvpool", "dynamic")):
            if r == 0:
                generate(kind)
                continue
            profs[kind].enable()
            try:
                generate(kind)
            finally:
                profs[kind].disable()
    per_token = 1e6 / (a.rounds * s.new_tokens)
    stats = {k: pstats.Stats(p).stats for k, p in profs.items()}  # type: ignore[attr-defined]
    totals = {k: sum(v[2] for v in st.values()) * per_token for k, st in stats.items()}
    keys = set(stats["dynamic"]) | set(stats["kvpool"])

    def own(kind: str, key: Any) -> tuple[float, float]:
        row = stats[kind].get(key)
        return (0.0, 0.0) if row is None else (row[1] / (a.rounds * s.new_tokens), row[2] * per_token)

    rows = []
    for key in keys:
        (cd, td), (ck, tk) = own("dynamic", key), own("kvpool", key)
        rows.append({"function": _where(key), "dynamic_us": td, "kvpool_us": tk, "diff_us": tk - td,
                     "dynamic_calls": cd, "kvpool_calls": ck})
    rows.sort(key=lambda r: -abs(r["diff_us"]))
    print(f"batch {a.batch}, {s.new_tokens} new tokens, {a.rounds} profiled rounds each, {a.device}; "
          f"own µs per new token under cProfile: dynamic {totals['dynamic']:.0f}, kvpool {totals['kvpool']:.0f} "
          f"({totals['kvpool'] - totals['dynamic']:+.0f})")
    print(f"{'diff':>8} {'kvpool':>8} {'dynamic':>8} {'calls k/d per token':>20}  function")
    for r in rows[:a.top]:
        print(f"{r['diff_us']:+8.1f} {r['kvpool_us']:8.1f} {r['dynamic_us']:8.1f} "
              f"{r['kvpool_calls']:9.2f}/{r['dynamic_calls']:<9.2f}  {r['function']}")
    if a.out:
        Path(a.out).write_text(json.dumps({"settings": {"batch": a.batch, "rounds": a.rounds,
                                                        "new_tokens": s.new_tokens, "device": a.device},
                                           "unit": "own µs per new token under cProfile",
                                           "totals": totals, "rows": rows[:200]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
