"""Tokens per second of transformers' ``generate`` with ``KVPoolCache`` vs its ``DynamicCache``.

The runs are ``kvpool.bench.hf_generate.compare`` (also behind ``python -m kvpool.bench
overhead``): same random-weight Llama, same prompts, same run, every (batch, cache) pair
once per round in alternating order, medians over rounds of the wall clock and of this
thread's CPU time; greedy, no early stop, float32 on CPU, one torch thread by default;
each round checks that both caches give the same tokens.

``--save-checkpoint PATH`` also writes the model with ``save_pretrained`` for
``python -m kvpool demo --hf PATH``.

Usage: python benchmarks/bench_hf.py [--out benchmarks/results/hf_cache.json] [--rounds 5]
       [--batches 1,8] [--prompt-len 128] [--new-tokens 64] [--page-size 16] [--save-checkpoint PATH]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess

import torch

import kvpool
from kvpool.bench.cli import check_outputs, count, list_of
from kvpool.bench.hf_generate import HFSettings, build_model, compare
from kvpool.bench.report import write_json

MAX_POSITIONS = 4096  # build_model's max_position_embeddings


def _batches(text: str) -> str:
    """--batches checked as parsed, kept as text (as the JSON records it)."""
    list_of(count(1))(text)
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/hf_cache.json")
    p.add_argument("--rounds", type=count(1), default=5)
    p.add_argument("--batches", type=_batches, default="1,8")
    p.add_argument("--prompt-len", type=count(1), default=128)
    p.add_argument("--new-tokens", type=count(1), default=64)
    p.add_argument("--page-size", type=count(1), default=16)
    p.add_argument("--hidden", type=count(1), default=256)
    p.add_argument("--layers", type=count(1), default=4)
    p.add_argument("--heads", type=count(1), default=8)
    p.add_argument("--kv-heads", type=count(1), default=2)
    p.add_argument("--vocab", type=count(4), default=2048, help="prompt ids are drawn from [3, vocab) (2048)")
    p.add_argument("--threads", type=count(1), default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model, prompts and pool live (cpu)")
    p.add_argument("--save-checkpoint", metavar="PATH")
    args = p.parse_args(argv)
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error(f"--hidden {args.hidden}, --heads {args.heads}, --kv-heads {args.kv_heads}: give a --hidden that "
                "--heads divides and --heads that --kv-heads divides")
    if args.prompt_len + args.new_tokens > MAX_POSITIONS:
        p.error(f"--prompt-len + --new-tokens is {args.prompt_len + args.new_tokens}; the model takes at most "
                f"{MAX_POSITIONS} positions")
    problem = check_outputs(args, [("--out", args.out)])  # before the run, not after it
    if problem:
        p.error(problem)
    torch.set_num_threads(args.threads)
    s = HFSettings(batches=tuple(int(b) for b in args.batches.split(",")), rounds=args.rounds,
                   prompt_len=args.prompt_len, new_tokens=args.new_tokens, page_size=args.page_size,
                   hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                   vocab=args.vocab, seed=args.seed, device=args.device)
    model = build_model(s)
    if args.save_checkpoint:
        model.save_pretrained(args.save_checkpoint)
        print(f"checkpoint written to {args.save_checkpoint}")
    run = compare(s, model)
    try:
        # The checkout this script is in, wherever it is run from.
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    import transformers
    result = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "save_checkpoint")},
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "kvpool": kvpool.__version__, "commit": commit, "cpus": os.cpu_count()},
        "token_mismatches": run["token_mismatches"], "results": run["results"],
    }
    print(f"generate tokens/s, Llama hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, float32 {args.device}, {args.threads} thread(s), "
          f"page {args.page_size}, median of {args.rounds} rounds (wall clock; CPU: this thread's CPU time)")
    print(f"{'batch':>5} {'DynamicCache':>13} {'KVPoolCache':>12} {'kvpool/dynamic':>15} {'(CPU time)':>11}")
    for row in run["results"]:
        print(f"{row['batch']:>5} {row['dynamic_tok_s']:>13.1f} {row['kvpool_tok_s']:>12.1f} "
              f"{row['kvpool_over_dynamic']:>15.3f} {row['kvpool_over_dynamic_cpu']:>11.3f}")
    print(f"token mismatches between the two caches: {run['token_mismatches']}")
    write_json(args.out, result)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
