"""Tokens per second of transformers' ``generate`` with ``KVPoolCache`` vs its ``DynamicCache``.

Same random-weight Llama model, same prompts, same run: each round runs every
(batch, cache) variant once, in alternating order, so machine noise hits them alike;
the figure is the median over rounds. Greedy, ``min_new_tokens = max_new_tokens``
(no early stop), float32 on CPU, one torch thread by default. Each KVPoolCache run
also checks that its tokens equal DynamicCache's.

``--save-checkpoint PATH`` also writes the model with ``save_pretrained`` for
``python -m kvpool demo --hf PATH``.

Usage: python benchmarks/bench_hf.py [--out benchmarks/results/hf_cache.json] [--rounds 5]
       [--batches 1,8] [--prompt-len 128] [--new-tokens 64] [--page-size 16] [--save-checkpoint PATH]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Any

import torch
from transformers import DynamicCache, GenerationMixin, LlamaConfig, LlamaForCausalLM

import kvpool
from kvpool.integrations.transformers import KVPoolCache, pool_for_model

# generate's cache argument: `cache` in recent 5.x, `past_key_values` before.
CACHE_KW = "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters \
    else "past_key_values"


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    with torch.inference_mode(False), torch.no_grad():
        torch.manual_seed(args.seed)
        return LlamaForCausalLM(cfg).eval()


def run_once(model: Any, ids: torch.Tensor, cache: Any, new_tokens: int) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **{CACHE_KW: cache}, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/hf_cache.json")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-checkpoint", metavar="PATH")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args)
    if args.save_checkpoint:
        model.save_pretrained(args.save_checkpoint)
        print(f"checkpoint written to {args.save_checkpoint}")
    batches = [int(b) for b in args.batches.split(",")]
    pool = pool_for_model(model, max_tokens=max(batches) * (args.prompt_len + args.new_tokens) + 64,
                          page_size=args.page_size, max_requests=max(batches),
                          max_context_len=args.prompt_len + args.new_tokens)
    g = torch.Generator().manual_seed(args.seed)
    prompts = {b: torch.randint(3, args.vocab, (b, args.prompt_len), generator=g) for b in batches}
    times: dict[tuple[int, str], list[float]] = {(b, c): [] for b in batches for c in ("dynamic", "kvpool")}
    mismatches = 0
    for r in range(args.rounds + 1):  # round 0 warms up and is not counted
        for b in batches:
            order = ("dynamic", "kvpool") if r % 2 == 0 else ("kvpool", "dynamic")
            seqs = {}
            for kind in order:
                if kind == "dynamic":
                    dt, seqs[kind] = run_once(model, prompts[b], DynamicCache(config=model.config), args.new_tokens)
                else:
                    with KVPoolCache(pool) as cache:
                        dt, seqs[kind] = run_once(model, prompts[b], cache, args.new_tokens)
                if r > 0:
                    times[(b, kind)].append(dt)
            mismatches += int(not torch.equal(seqs["dynamic"], seqs["kvpool"]))
    pool.allocator.check()
    rows = []
    for b in batches:
        dyn, kvp = (statistics.median(times[(b, k)]) for k in ("dynamic", "kvpool"))
        tokens = b * args.new_tokens
        rows.append({"batch": b, "dynamic_tok_s": tokens / dyn, "kvpool_tok_s": tokens / kvp,
                     "kvpool_over_dynamic": dyn / kvp, "dynamic_s": dyn, "kvpool_s": kvp})
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip()
    except OSError:
        commit = ""
    import transformers
    result = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "save_checkpoint")},
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "kvpool": kvpool.__version__, "commit": commit, "cpus": os.cpu_count()},
        "token_mismatches": mismatches, "results": rows,
    }
    print(f"generate tokens/s, Llama hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, float32 CPU, {args.threads} thread(s), "
          f"page {args.page_size}, median of {args.rounds} rounds")
    print(f"{'batch':>5} {'DynamicCache':>13} {'KVPoolCache':>12} {'kvpool/dynamic':>15}")
    for row in rows:
        print(f"{row['batch']:>5} {row['dynamic_tok_s']:>13.1f} {row['kvpool_tok_s']:>12.1f} "
              f"{row['kvpool_over_dynamic']:>15.3f}")
    print(f"token mismatches between the two caches: {mismatches}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
