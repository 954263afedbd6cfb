"""``generate`` tokens/s with ``KVPoolCache`` against transformers' ``DynamicCache``.

Same random-weight Llama, same prompts, same run: each round runs every
(batch, cache) pair once, the two caches in alternating order, so drift on a
shared host lands on both alike; figures are medians over rounds. Greedy,
``min_new_tokens = max_new_tokens`` (no early stop), float32, under
``torch.inference_mode()``. Each round also checks that both caches produced
the same tokens. Both the wall clock and this thread's CPU time are recorded
per run (torch runs on this thread at one intra-op thread): on a loaded host
the CPU time is the steadier of the two. One pool serves every batch size, as
a server's does.

Two more figures per batch, because at batch 1 the caches' work is a small share
of a step (the model's matmuls are the rest) and host drift between the runs of
a round moves the ratio by more than the caches differ:
- the paired ratio, the median over rounds of each round's own DynamicCache
  time over its KVPoolCache time, with a 95% bootstrap interval of that median:
  an interval that straddles 1.0 says the run cannot tell the caches apart;
- each cache's own host µs per decode step (``update`` of every layer, one token
  a row, after a prompt's prefill), the caches alternated within each round.

Used by ``python -m kvpool.bench overhead`` and ``benchmarks/bench_hf.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
import statistics
import time
from typing import Any

import torch

__all__ = ["HFSettings", "build_model", "compare", "run_once"]


@dataclasses.dataclass
class HFSettings:
    batches: tuple[int, ...] = (1, 8)
    rounds: int = 5
    prompt_len: int = 128
    new_tokens: int = 64
    page_size: int = 16
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 2048
    seed: int = 0
    device: str = "cpu"  # "cuda": model, prompts and pool on the GPU, timed with a sync at each end


def cache_kw() -> str:
    """``generate``'s cache argument: ``cache`` in recent 5.x, ``past_key_values`` before."""
    from transformers import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


def build_model(s: HFSettings) -> Any:
    """A random-weight Llama (float32, eval mode), built outside inference mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.hidden * 8 // 3 // 64 * 64,
                      num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                      max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)
    with torch.inference_mode(False), torch.no_grad():
        torch.manual_seed(s.seed)
        return LlamaForCausalLM(cfg).eval().to(s.device)


def _sync(device: Any) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_once(model: Any, ids: torch.Tensor, cache: Any, new_tokens: int) -> tuple[float, float, torch.Tensor]:
    """(wall s, this thread's CPU s, sequences) of one greedy ``generate``."""
    _sync(ids.device)
    c0, t0 = time.thread_time(), time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **{cache_kw(): cache},
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    _sync(ids.device)
    return time.perf_counter() - t0, time.thread_time() - c0, out


def update_us(make: Any, s: HFSettings, batch: int, steps: int) -> float:
    """Host µs per decode step of ``make()``'s cache alone: ``update`` of every layer with one
    token a row, after a prefill of ``prompt_len``, under inference mode as ``generate`` runs."""
    hd = s.hidden // s.heads
    g = torch.Generator().manual_seed(s.seed)
    with torch.inference_mode(), make() as cache:
        kv = torch.randn(batch, s.kv_heads, s.prompt_len, hd, generator=g).to(s.device)
        for layer in range(s.layers):
            cache.update(kv, kv, layer)
        one = torch.randn(batch, s.kv_heads, 1, hd, generator=g).to(s.device)
        _sync(s.device)
        t0 = time.perf_counter_ns()
        for _ in range(steps):
            for layer in range(s.layers):
                cache.update(one, one, layer)
        _sync(s.device)
        return (time.perf_counter_ns() - t0) / steps / 1e3


def median_interval(xs: list[float], level: float = 0.95, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of ``median(xs)``: how far the median of this many
    rounds moves from run to run. Seeded, so a JSON record reproduces from its rounds."""
    rng = random.Random(seed)
    n = len(xs)
    meds = sorted(statistics.median(rng.choices(xs, k=n)) for _ in range(resamples))
    lo = int((1 - level) / 2 * resamples)
    return meds[lo], meds[resamples - 1 - lo]


class _Closing:
    """A DynamicCache in a ``with`` block, as KVPoolCache is used."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def __enter__(self) -> Any:
        return self.cache

    def __exit__(self, *exc: object) -> None:
        return None


def compare(s: HFSettings, model: Any = None) -> dict[str, Any]:
    """Rounds of alternated runs; per batch the medians and the ratios (KVPoolCache's
    tokens/s over DynamicCache's, wall and CPU), and the token mismatches."""
    from transformers import DynamicCache

    from kvpool.integrations.transformers import KVPoolCache, pool_for_model

    model = model if model is not None else build_model(s)
    top = max(s.batches)
    per_row = -(-(s.prompt_len + s.new_tokens) // s.page_size) * s.page_size  # whole pages a row holds
    pool = pool_for_model(model, max_tokens=top * per_row + 64, page_size=s.page_size,
                          max_requests=top, max_context_len=s.prompt_len + s.new_tokens)
    g = torch.Generator().manual_seed(s.seed)
    prompts = {b: torch.randint(3, s.vocab, (b, s.prompt_len), generator=g).to(s.device) for b in s.batches}
    times: dict[tuple[int, str], list[tuple[float, float]]] = {(b, c): [] for b in s.batches
                                                                for c in ("dynamic", "kvpool")}
    mismatches = 0
    for r in range(s.rounds + 1):  # round 0 warms up and is not counted
        for b in s.batches:
            seqs = {}
            for kind in (("dynamic", "kvpool") if r % 2 == 0 else ("kvpool", "dynamic")):
                if kind == "dynamic":
                    wall, cpu, seqs[kind] = run_once(model, prompts[b], DynamicCache(config=model.config),
                                                     s.new_tokens)
                else:
                    with KVPoolCache(pool) as cache:
                        wall, cpu, seqs[kind] = run_once(model, prompts[b], cache, s.new_tokens)
                if r > 0:
                    times[(b, kind)].append((wall, cpu))
            mismatches += int(not torch.equal(seqs["dynamic"], seqs["kvpool"]))
    makers = {"dynamic": lambda: _Closing(DynamicCache(config=model.config)), "kvpool": lambda: KVPoolCache(pool)}
    cache_us: dict[tuple[int, str], list[float]] = {k: [] for k in times}
    for r in range(s.rounds + 1):
        for b in s.batches:
            for kind in (("dynamic", "kvpool") if r % 2 == 0 else ("kvpool", "dynamic")):
                us = update_us(makers[kind], s, b, steps=s.new_tokens)
                if r > 0:
                    cache_us[(b, kind)].append(us)
    pool.allocator.check()
    rows = []
    for b in s.batches:
        med = {k: [statistics.median(x[i] for x in times[(b, k)]) for i in (0, 1)] for k in ("dynamic", "kvpool")}
        paired = [d[0] / k[0] for d, k in zip(times[(b, "dynamic")], times[(b, "kvpool")])]
        tokens = b * s.new_tokens
        rows.append({
            "batch": b,
            "dynamic_tok_s": tokens / med["dynamic"][0], "kvpool_tok_s": tokens / med["kvpool"][0],
            "kvpool_over_dynamic": med["dynamic"][0] / med["kvpool"][0],
            "kvpool_over_dynamic_paired": statistics.median(paired),
            "kvpool_over_dynamic_paired_95": list(median_interval(paired)),
            "dynamic_update_us": statistics.median(cache_us[(b, "dynamic")]),
            "kvpool_update_us": statistics.median(cache_us[(b, "kvpool")]),
            "dynamic_cpu_tok_s": tokens / med["dynamic"][1], "kvpool_cpu_tok_s": tokens / med["kvpool"][1],
            "kvpool_over_dynamic_cpu": med["dynamic"][1] / med["kvpool"][1],
            "dynamic_s": med["dynamic"][0], "kvpool_s": med["kvpool"][0],
            "dynamic_cpu_s": med["dynamic"][1], "kvpool_cpu_s": med["kvpool"][1],
        })
    return {"settings": dataclasses.asdict(s), "token_mismatches": mismatches, "results": rows}
