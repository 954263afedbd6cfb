"""The prefix targets: hit-rate parity with the baseline that caches by the same rules, and speed."""

from __future__ import annotations

from typing import Any

from kvpool.bench.columns import size
from kvpool.bench.prefix.result import PrefixResult
from kvpool.bench.report import NO_BASELINE, against_kvpool, or_none, ratio_line, time_ratios

SPEEDUP_TARGET = 10.0  # baseline µs/step ÷ kvpool µs/step, every scenario
# Rows with a host tier, held against kvpool-host rather than the device-only kvpool row.
TIER_ROWS = ("kvpool-host", "kvpool-host-wt", "vllm-offload-lru", "vllm-offload-arc")
# Bytes per token of Llama-3-8B's KV cache (32 layers x 8 KV heads x 128 x K and V x bf16):
# what "MiB moved per step" is quoted at.
LLAMA8B_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
SGLANG_HIT_TOLERANCE = 0.02  # kvpool hit tokens >= (1 - this) x SGLang's at page 1
# Whose hits kvpool's are held against at each page size: at 16 vLLM's, which, like kvpool,
# caches full pages only and evicts LRU; at 1 SGLang's token-granular radix tree.
PARITY = {16: "vllm", 1: "sglang"}


def prefix_ratios(results: list[PrefixResult]) -> dict[str, Any]:
    """Hit parity (kvpool vs vLLM at page 16, vs SGLang at page 1) and baseline/kvpool µs per step."""
    parity: dict[str, Any] = {}
    speed: dict[str, Any] = {}
    for r, kv in against_kvpool(results):
        if r.allocator in TIER_ROWS:
            continue  # held against their own: tier_ratios
        label = f"{r.scenario} page {r.page_size} {size(r.num_slots)} {r.allocator}"
        if PARITY.get(r.page_size) == r.allocator:
            tol = SGLANG_HIT_TOLERANCE if r.allocator == "sglang" else 0.0
            parity[label] = {
                "kvpool_hit_tokens": kv.hit_tokens, "baseline_hit_tokens": r.hit_tokens,
                "kvpool_hit_share": round(kv.hit_share, 4), "baseline_hit_share": round(r.hit_share, 4),
                "ratio": round(kv.hit_tokens / r.hit_tokens, 4) if r.hit_tokens else None,
                "meets_target": kv.hit_tokens >= (1 - tol) * r.hit_tokens}
        speed[label] = {
            **time_ratios(r, kv, 2), "kvpool_hits_at_least_as_many": kv.hit_tokens >= r.hit_tokens,
            "meets_target": r.mean_us / kv.mean_us >= SPEEDUP_TARGET}
    out = {"parity": parity, "baseline_over_kvpool": speed, "speedup_target": SPEEDUP_TARGET,
           "sglang_hit_tolerance": SGLANG_HIT_TOLERANCE}
    tiers = tier_ratios(results)
    if tiers:  # only runs with host-tier rows have the block
        out["host_tier"] = tiers
    return out


def tier_ratios(results: list[PrefixResult]) -> dict[str, Any]:
    """The host tier's targets on each trace that has the rows: hits with the tier >= without
    (kvpool vs kvpool-host: prefill tokens saved), >= vLLM's CPU offloading at equal device
    and host capacity, and vLLM's host µs per step (KVCacheManager + CPUOffloadingManager)
    >= 10x kvpool-host's; plus pages and bytes moved per step."""
    by_case: dict[Any, dict[str, PrefixResult]] = {}
    for r in results:
        by_case.setdefault(r.case, {})[r.allocator] = r
    out: dict[str, Any] = {}
    for rows in by_case.values():
        dev, host = rows.get("kvpool"), rows.get("kvpool-host")
        if host is None:
            continue
        label = f"{host.scenario} page {host.page_size} {size(host.num_slots)}"
        page_bytes = LLAMA8B_BYTES_PER_TOKEN * host.page_size
        entry: dict[str, Any] = {"host_pages": host.host_pages, "device_pages": host.num_slots // host.page_size,
                                 "rows": {}}
        for name in ("kvpool", *TIER_ROWS):
            r = rows.get(name)
            if r is None:
                continue
            entry["rows"][name] = {
                "hit_share": round(r.hit_share, 4), "hit_tokens": r.hit_tokens, "mean_us": round(r.mean_us, 2),
                "offloaded_pages_per_step": round(r.offloaded_pages / r.steps, 3),
                "loaded_pages_per_step": round(r.loaded_pages / r.steps, 3),
                "llama8b_mib_moved_per_step": round(r.moved_pages_per_step * page_bytes / 2**20, 2)}
        if dev is not None:
            entry["prefill_tokens_saved_by_the_tier"] = host.hit_tokens - dev.hit_tokens
            entry["no_worse_than_device_only"] = host.hit_tokens >= dev.hit_tokens
        for name in ("vllm-offload-lru", "vllm-offload-arc"):
            v = rows.get(name)
            if v is not None:
                entry[f"vs_{name}"] = {"hits_at_least_as_many": host.hit_tokens >= v.hit_tokens,
                                       **time_ratios(v, host, 2),
                                       "meets_target": host.hit_tokens >= v.hit_tokens
                                       and v.mean_us / host.mean_us >= SPEEDUP_TARGET}
        out[label] = entry
    return out


def tier_lines(ratios: dict[str, Any]) -> str:
    if not ratios.get("host_tier"):
        return ""
    lines = ["\nHost tier (kvpool-host: write_back; device-only kvpool and vLLM's CPU offloading on the same "
             "trace, same device and host pages; MiB at a Llama-3-8B page):"]
    for label, e in ratios["host_tier"].items():
        lines.append(f"  {label}: {e['device_pages']} device pages, {e['host_pages']} host pages")
        for name, r in e["rows"].items():
            lines.append(f"    {name:18s} hit {100 * r['hit_share']:5.1f}%  {r['mean_us']:8.1f} µs/step  "
                         f"offload {r['offloaded_pages_per_step']:7.2f}  load {r['loaded_pages_per_step']:7.2f} "
                         f"pages/step  {r['llama8b_mib_moved_per_step']:8.2f} MiB/step")
        if "prefill_tokens_saved_by_the_tier" in e:
            ok = "meets" if e["no_worse_than_device_only"] else "MISSES"
            lines.append(f"    prefill tokens saved by the tier: {e['prefill_tokens_saved_by_the_tier']}  "
                         f"(no worse than device-only: {ok} target)")
        for name in ("vllm-offload-lru", "vllm-offload-arc"):
            v = e.get(f"vs_{name}")
            if v is not None:
                lines.append(ratio_line(f"{name} ÷ kvpool-host", v, "8.1f",
                                        extra=f"{'=hits' if v['hits_at_least_as_many'] else 'fewer hits':10s} "))
    return "\n".join(lines)


def parity_lines(ratios: dict[str, Any]) -> str:
    lines = ["\nHit-rate parity: kvpool's prefix-hit tokens vs vLLM's at page 16 (target >=) "
             f"and SGLang's at page 1 (target >= {100 * (1 - SGLANG_HIT_TOLERANCE):g}%):"]
    for name, v in ratios["parity"].items():
        ok = "meets" if v["meets_target"] else "MISSES"
        ratio = f"{v['ratio']:.3f}" if v["ratio"] is not None else "n/a"
        lines.append(f"  {name:34s} kvpool {100 * v['kvpool_hit_share']:5.1f}%  baseline "
                     f"{100 * v['baseline_hit_share']:5.1f}%  ratio {ratio}  {ok} target")
    if not ratios["parity"]:
        lines.append(NO_BASELINE)
    lines.append(f"Baseline µs/step ÷ kvpool µs/step (target >= {SPEEDUP_TARGET:g}x; "
                 "'=hits' where kvpool hits at least as many tokens):")
    lines += or_none([ratio_line(name, v, "8.1f",
                                 extra=f"{'=hits' if v['kvpool_hits_at_least_as_many'] else 'fewer hits':10s} ")
                      for name, v in ratios["baseline_over_kvpool"].items()])
    return "\n".join(lines) + tier_lines(ratios)


__all__ = ["PARITY", "SGLANG_HIT_TOLERANCE", "SPEEDUP_TARGET", "TIER_ROWS", "parity_lines", "prefix_ratios",
           "tier_lines", "tier_ratios"]
