"""Figures of a demo run: one dict (written by --json) and its text rendering."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from kvpool.demo.engine import RunStats
from kvpool.demo.timing import BOOKKEEPING, STORES

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 48, lo: float = 0.0, hi: float = 1.0) -> str:
    """Values in [lo, hi] as block characters, each the mean of an equal chunk of the run."""
    if not values:
        return ""
    chunks = np.array_split(np.asarray(values, dtype=np.float64), min(width, len(values)))
    out = []
    for c in chunks:
        frac = (float(c.mean()) - lo) / (hi - lo) if hi > lo else 0.0
        out.append(SPARK[int(round(min(max(frac, 0.0), 1.0) * (len(SPARK) - 1)))])
    return "".join(out)


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"min": 0.0, "mean": 0.0, "max": 0.0}
    a = np.asarray(values, dtype=np.float64)
    return {"min": float(a.min()), "mean": float(a.mean()), "max": float(a.max())}


def _samples(values: list[float], n: int = 11) -> list[float]:
    """A few evenly spaced samples (start ... end) so the JSON shows the run's shape."""
    if not values:
        return []
    idx = np.linspace(0, len(values) - 1, num=min(n, len(values))).round().astype(int)
    return [round(float(values[i]), 4) for i in idx]


def audit_to_jsonable(result: Any) -> Any:
    """kvpool.audit's result in a JSON-friendly form, whatever container it uses."""
    if result is None or isinstance(result, (bool, int, float, str)):
        return result
    if hasattr(result, "to_dict"):
        return audit_to_jsonable(result.to_dict())
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return audit_to_jsonable(dataclasses.asdict(result))
    if isinstance(result, dict):
        return {str(k): audit_to_jsonable(v) for k, v in result.items()}
    if isinstance(result, (list, tuple, set)):
        return [audit_to_jsonable(v) for v in result]
    return str(result)


def audit_is_clean(result: Any) -> bool:
    for attr in ("ok", "clean"):
        if hasattr(result, attr):
            return bool(getattr(result, attr))
    if isinstance(result, dict):
        for key in ("ok", "clean"):
            if key in result:
                return bool(result[key])
    return not result  # an empty list of findings


def figures(stats: RunStats, *, settings: dict[str, Any], audit: Any) -> dict[str, Any]:
    step_s = stats.step_s or float("nan")
    bookkeeping = sum(stats.pool_seconds.get(n, 0.0) for n in BOOKKEEPING)
    stores = sum(stats.pool_seconds.get(n, 0.0) for n in STORES)
    return {
        "settings": settings,
        "requests_done": stats.requests_done,
        "steps": stats.steps,
        "elapsed_s": stats.elapsed_s,
        "generated_tokens": stats.generated_tokens,
        "prefill_tokens": stats.prefill_tokens,
        "decode_tokens": stats.decode_tokens,
        "tokens_per_s": stats.generated_tokens / stats.elapsed_s if stats.elapsed_s else 0.0,
        "total_tokens_per_s": ((stats.generated_tokens + stats.prefill_tokens) / stats.elapsed_s
                               if stats.elapsed_s else 0.0),
        "preemptions": stats.preemptions,
        "recomputed_tokens": stats.recomputed_tokens,
        "steps_blocked_by_pool": stats.steps_blocked_by_pool,
        "batch_size": _summary([float(b) for b in stats.batch_sizes]),
        "occupancy": {**_summary(stats.occupancy), "samples": _samples(stats.occupancy)},
        "token_occupancy": {**_summary(stats.token_occupancy),
                            "samples": _samples(stats.token_occupancy)},
        "pool_host": {
            "bookkeeping_s": bookkeeping,
            "write_s": stores,
            "bookkeeping_share": bookkeeping / step_s,
            "write_share": stores / step_s,
            "share": (bookkeeping + stores) / step_s,
            "bookkeeping_us_per_step": 1e6 * bookkeeping / max(stats.steps, 1),
            "seconds_by_call": stats.pool_seconds,
            "calls": stats.pool_calls,
        },
        "audit": {"clean": audit_is_clean(audit), "result": audit_to_jsonable(audit),
                  "lines": [str(f) for f in audit] if isinstance(audit, (list, tuple)) else [str(audit)]},
    }


def _graph_note(s: dict[str, Any]) -> str:
    if not s["cuda_graph"]:
        return ""
    if s["device"].startswith("cuda"):
        return " + CUDA graphs (DecodeGraphRunner)"
    return " + DecodeGraphRunner (eager on CPU, padded buckets)"


def render(fig: dict[str, Any], occupancy: list[float]) -> str:
    s, host, occ = fig["settings"], fig["pool_host"], fig["occupancy"]
    lines = [
        "kvpool demo — continuous batching on a KVPool",
        f"  model    {s['model']['layers']} layers, hidden {s['model']['hidden']}, "
        f"{s['model']['heads']} heads / {s['model']['kv_heads']} kv heads, "
        f"vocab {s['model']['vocab_size']}"
        + (f", {s['model']['architecture']} checkpoint {s['model']['hf_path']}" if "hf_path" in s["model"] else "")
        + f", {s['dtype']} on {s['device']} "
        f"({s['threads']} CPU thread{'s' if s['threads'] > 1 else ''})"
        f"{_graph_note(s)}, grad mode {s['grad_mode']}",
        f"  pool     {s['pool_tokens']} tokens in pages of {s['page_size']} ({s['layout']} layout), "
        f"max {s['max_running']} running",
        f"  requests {fig['requests_done']}/{s['requests']} done in {fig['steps']} steps, "
        f"{fig['elapsed_s']:.1f} s",
        f"  tokens   {fig['generated_tokens']} generated ({fig['tokens_per_s']:.0f} tok/s), "
        f"{fig['prefill_tokens']} prefilled ({fig['total_tokens_per_s']:.0f} tok/s in all)",
        f"  batch    decode batch min/mean/max {fig['batch_size']['min']:.0f}/"
        f"{fig['batch_size']['mean']:.1f}/{fig['batch_size']['max']:.0f}; "
        f"admission waited for pool room in {fig['steps_blocked_by_pool']} steps, "
        f"{fig['preemptions']} preemptions"
        + (f" ({fig['recomputed_tokens']} generated tokens thrown away and recomputed)"
           if fig.get("recomputed_tokens") else ""),
        f"  occupancy pages used min/mean/max {occ['min']:.0%}/{occ['mean']:.0%}/{occ['max']:.0%}"
        f"  |{sparkline(occupancy)}|",
        (f"           tokens stored mean {fig['token_occupancy']['mean']:.0%} of capacity "
         f"(the gap to pages used: partly filled last pages)" if "prefix" not in fig else
         f"           request lengths sum to {fig['token_occupancy']['mean']:.0%} of capacity on average "
         f"(a shared page counts once per request holding it)"),
        f"  kvpool host calls {host['share']:.1%} of step time: bookkeeping "
        f"(open/extend/close) {host['bookkeeping_share']:.2%} "
        f"({host['bookkeeping_us_per_step']:.0f} µs/step), K/V writes {host['write_share']:.1%}",
    ]
    if "prefix" in fig:
        px = fig["prefix"]
        lines.append(f"  prefix   {px['hit_rate']:.1%} of prompt tokens hit the prefix cache "
                     f"({px['hit_tokens']} of {px['prompt_tokens']}); {px['forks']} forked continuations "
                     f"shared {px['forked_tokens']}; prefill tokens saved {px['prefill_tokens_saved']} "
                     f"({px['prefill_saved_share']:.1%} of prompt tokens)")
    if fig["audit"]["clean"]:
        lines.append("  audit    kvpool.audit(model, pool): clean — no inference or requires-grad "
                     "tensors among the weights, buffers and pool tensors")
    else:
        lines.append("  audit    kvpool.audit(model, pool) FINDINGS:")
        lines.extend(f"    - {f}" for f in fig["audit"]["lines"])
    return "\n".join(lines)
