"""``python -m kvpool.bench overhead``: what the torch layer adds on the host, in one place.

Three sections (``--sections``, default all), each printed as a table and
written as its own JSON file under ``--out`` (``<prefix>-<section>.json``):

- ``rows``: ``KVPool.write`` / ``read`` over the bare copies they make, per
  layout, at 1 and 64 rows (``kvpool.bench.rows_cost``);
- ``hf``: ``generate`` tokens/s with ``KVPoolCache`` against ``DynamicCache``
  at batch 1 and 8 (``kvpool.bench.hf_generate``; needs transformers);
- ``burst``: a fresh allocator's construction time and first admission
  against the same admission on it once warm, at 1M and 16M slots, pages 1
  and 16, each run in a fresh process (``kvpool/bench/first_burst.py``).

Wall-clock figures come with the same calls' thread CPU time: on a shared
host a descheduled thread inflates the first and not the second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from kvpool.bench import report
from kvpool.bench.cli import add_out_argument, count, list_of, one_of, settings

SECTIONS = ["rows", "hf", "burst"]
# --quick: a few rounds of each (a flag given explicitly keeps its value).
QUICK_DEFAULTS = dict(rounds=3, calls=20, hf_rounds=1, burst_reps=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sections", type=list_of(one_of(SECTIONS, "section")), default=list(SECTIONS),
                   help=f"subset of {','.join(SECTIONS)}")
    p.add_argument("--rounds", type=count(1), default=15, help="rows: rounds of alternated variants")
    p.add_argument("--calls", type=count(1), default=200, help="rows: calls per variant per round")
    p.add_argument("--hf-rounds", type=count(1), default=7, help="hf: alternated rounds of generate")
    p.add_argument("--hf-lengths", type=list_of(_hf_length), default=["128:64"],
                   help="hf: prompt:new_tokens pairs, each a table (the first is the target's; "
                        "DynamicCache copies its whole cache each step, so longer ones show the trend)")
    p.add_argument("--burst-reps", type=count(1), default=5, help="burst: fresh processes per case")
    p.add_argument("--quick", action="store_true",
                   help="a few rounds of each: runs in seconds (tests); flags given explicitly keep their values")
    add_out_argument(p)
    p.add_argument("--json-prefix", default="overhead", help="JSON files <prefix>-<section>.json ('' for none)")


# ----- rows ---------------------------------------------------------------


def rows_section(args: argparse.Namespace) -> dict[str, Any]:
    from kvpool.bench.rows_cost import row_overhead

    return {"results": row_overhead("cpu", rounds=args.rounds, calls=args.calls)}


def rows_table(doc: dict[str, Any]) -> str:
    head = ["layout", "rows", "bare copies µs", "write µs", "write + µs", "(cpu)", "caller's slots + µs",
            "core copy µs", "write over it + µs", "bare reads µs", "read + µs", "(cpu)"]
    body = [[r["layout"], str(r["rows"]), f"{r['bare_write_us']:.2f}", f"{r['write_us']:.2f}",
             f"{r['write_overhead_us']:.2f}", f"{r['write_overhead_cpu_us']:.2f}",
             f"{r['write_caller_overhead_us']:.2f}", f"{r['bare_scatter_us']:.2f}",
             f"{r['write_over_scatter_overhead_us']:.2f}", f"{r['bare_read_us']:.2f}",
             f"{r['read_overhead_us']:.2f}", f"{r['read_overhead_cpu_us']:.2f}"] for r in doc["results"]]
    return ("write / read over bare index_copy_ / index_select (bf16, 8 KV heads x 128; '+': the median "
            "over rounds of the difference, target <= 10 µs for write). A CPU write stores with the core's "
            "row copy, not index_copy_: 'core copy' is that copy called bare, and 'write over it' the torch "
            "layer's own cost\n" + report.md_table(head, body))


# ----- hf -----------------------------------------------------------------


def hf_section(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        return {"skipped": f"needs transformers (pip install 'kvpool[hf]'): {e}"}
    from kvpool.bench.hf_generate import HFSettings, compare

    lengths = [_length(x) for x in args.hf_lengths]
    if args.quick:
        tiny = dict(hidden=64, layers=2, heads=4, kv_heads=2, vocab=128)
        runs = [compare(HFSettings(rounds=args.hf_rounds, prompt_len=16 * (i + 1), new_tokens=4, **tiny))
                for i in range(len(lengths))]
    else:
        runs = [compare(HFSettings(rounds=args.hf_rounds, prompt_len=p, new_tokens=n)) for p, n in lengths]
    doc = runs[0]
    if len(runs) > 1:
        doc["more_lengths"] = runs[1:]
    return doc


def _length(text: str) -> tuple[int, int]:
    prompt, new = (int(x) for x in text.split(":"))
    return prompt, new


def _hf_length(text: str) -> str:
    """One --hf-lengths pair, checked as the command line is parsed (kept as text, as the JSON records it)."""
    try:
        prompt, new = _length(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hf-lengths takes prompt:new_tokens pairs such as 128:64, "
                                         f"got {text!r}") from None
    if prompt < 1 or new < 1:
        raise argparse.ArgumentTypeError(f"--hf-lengths needs positive lengths such as 128:64, got {text!r}")
    return text.strip()


def hf_table(doc: dict[str, Any]) -> str:
    if "skipped" in doc:
        return f"KVPoolCache vs DynamicCache: skipped, {doc['skipped']}"
    return "\n\n".join(_hf_one_table(d) for d in [doc, *doc.get("more_lengths", [])])


def _hf_one_table(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    head = ["batch", "DynamicCache tok/s", "KVPoolCache tok/s", "kvpool / dynamic", "(cpu time)", "(paired)",
            "(paired, 95%)", "DynamicCache update µs/step", "KVPoolCache update µs/step"]
    body = [[str(r["batch"]), f"{r['dynamic_tok_s']:.1f}", f"{r['kvpool_tok_s']:.1f}",
             f"{r['kvpool_over_dynamic']:.3f}", f"{r['kvpool_over_dynamic_cpu']:.3f}",
             f"{r['kvpool_over_dynamic_paired']:.3f}",
             "{:.3f}-{:.3f}".format(*r["kvpool_over_dynamic_paired_95"]), f"{r['dynamic_update_us']:.1f}",
             f"{r['kvpool_update_us']:.1f}"] for r in doc["results"]]
    return (f"generate, random Llama hidden {s['hidden']} x {s['layers']} layers, prompt {s['prompt_len']}, "
            f"{s['new_tokens']} new tokens, page {s['page_size']}, median of {s['rounds']} alternated rounds "
            f"(target >= 1.0); token mismatches {doc['token_mismatches']}\n" + report.md_table(head, body))


# ----- burst --------------------------------------------------------------

BURST_CASES = [(slots, page, prompts) for prompts in ("mixed", "2048") for slots in (1 << 20, 1 << 24)
               for page in (1, 16)]


def _burst_runs(script: str, reps: int, *argv: str) -> list[dict[str, Any]]:
    runs = []
    for _ in range(reps):
        r = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, check=True)
        runs.append(json.loads(r.stdout))
    return runs


def burst_section(args: argparse.Namespace) -> dict[str, Any]:
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "first_burst.py")
    cases = BURST_CASES[:2] if args.quick else BURST_CASES
    reps = args.burst_reps
    # The same-run baseline: the same flow with a plain write of the bytes an admission writes
    # (result array and table entries) instead of a pool (`first_burst.PlainWrites`), per prompt
    # set. Its own first / warm is what any first burst of that size pays in this process.
    controls: dict[str, dict[str, float]] = {}
    out = []
    for slots, page, prompts in cases:
        if prompts not in controls:
            runs = _burst_runs(script, reps, str(slots), str(page), prompts, "control")
            controls[prompts] = {
                "first_ns_per_token": statistics.median(x["first_ns_per_token"] for x in runs),
                "warm_ns_per_token": statistics.median(x["warm_ns_per_token"] for x in runs),
                "first_over_warm": statistics.median(x["first_ns_per_token"] / x["warm_ns_per_token"]
                                                     for x in runs)}
        runs = _burst_runs(script, reps, str(slots), str(page), prompts)
        row = {k: runs[0][k] for k in ("slots", "page_size", "prompts", "tokens")}
        for k in ("construct_ms", "first_ns_per_token", "warm_ns_per_token", "first_faults", "warm_faults"):
            row[k] = statistics.median(x[k] for x in runs)
        row["first_over_warm"] = statistics.median(x["first_ns_per_token"] / x["warm_ns_per_token"] for x in runs)
        row["control"] = controls[prompts]
        row["runs"] = runs
        out.append(row)
    return {"results": out}


def burst_table(doc: dict[str, Any]) -> str:
    head = ["prompts", "slots", "page", "construct ms", "first ns/token", "warm ns/token", "first / warm",
            "plain writes: first / warm ns/token", "plain first / warm", "first faults", "warm faults"]
    body = [[r["prompts"], f"{r['slots'] >> 20}M", str(r["page_size"]), f"{r['construct_ms']:.2f}",
             f"{r['first_ns_per_token']:.2f}", f"{r['warm_ns_per_token']:.2f}", f"{r['first_over_warm']:.2f}",
             f"{r['control']['first_ns_per_token']:.2f} / {r['control']['warm_ns_per_token']:.2f}",
             f"{r['control']['first_over_warm']:.2f}", f"{r['first_faults']:.0f}", f"{r['warm_faults']:.0f}"]
            for r in doc["results"]]
    return ("SlotAllocator.admit of 256 prompts into a fresh pool vs the same admission once warm (fresh "
            "process per run, medians; targets: first / warm <= 1.5, construct <= 50 ms at 1M page 1); "
            "'plain writes': the same flow writing the admission's result array and table entries "
            "without a pool, the same run's baseline for a first burst in this process\n"
            + report.md_table(head, body))


RUN = {"rows": (rows_section, rows_table), "hf": (hf_section, hf_table), "burst": (burst_section, burst_table)}


def main(args: argparse.Namespace, machine: dict[str, Any]) -> int:
    for name in args.sections:
        section, table = RUN[name]
        doc = section(args)
        print(table(doc))
        if args.json_prefix:
            path = report.output_path(args.out, f"{args.json_prefix}-{name}.json")
            report.write_json(path, {"benchmark": f"overhead/{name}", "settings": settings(args),
                                     "machine": machine, **doc})
            print(f"wrote {path}")
    return 0


__all__ = ["BURST_CASES", "SECTIONS", "add_arguments", "main"]
