"""``python -m kvpool demo``: serve synthetic requests with continuous batching on a KVPool."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kvpool.demo import _args
from kvpool.demo._args import (
    _check_allocator_bounds,
    _check_request_memory,
    _device,
    _non_negative,
    _path,
    _positive,
    _range,
    _seed,
    _share,
    _threads,
    model_bytes,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GRAD_MODES = ("inference", "no_grad", "none")


def grad_mode(name: str) -> contextlib.AbstractContextManager[Any]:
    """The caller-side grad mode the whole demo (construction included) runs under."""
    if name == "inference":
        return torch.inference_mode()
    if name == "no_grad":
        return torch.no_grad()
    return contextlib.nullcontext()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpool demo",
        description="Serve seeded synthetic requests with continuous batching on a kvpool.KVPool "
                    "and a small random-weight transformer; print throughput, pool occupancy, "
                    "kvpool's share of step time and kvpool.audit's findings.")
    g = p.add_argument_group("workload")
    g.add_argument("--requests", type=_positive, default=128, help="number of requests (128)")
    g.add_argument("--prompt-len", type=_range, default=(16, 256), metavar="MIN:MAX",
                   help="prompt length range, uniform (16:256)")
    g.add_argument("--output-len", type=_range, default=(16, 192), metavar="MIN:MAX",
                   help="generated tokens per request, uniform (16:192)")
    g.add_argument("--seed", type=_seed, default=0, help="seeds the weights and the requests (0)")
    g.add_argument("--workload", choices=("default", "shared-prefix"), default="default",
                   help="default: independent random prompts; shared-prefix: prompts are one of "
                        "--system-prompts system prompts plus a user turn, a --fork-share of them fork "
                        "into --fork-n continuations, served with kvpool's prefix cache and fork")
    g.add_argument("--system-prompts", type=_positive, default=4, help="shared-prefix: system prompts (4)")
    g.add_argument("--system-len", type=_range, default=(64, 192), metavar="MIN:MAX",
                   help="shared-prefix: system prompt length range (64:192)")
    g.add_argument("--fork-share", type=_share, default=0.25,
                   help="shared-prefix: share of requests that fork (0.25)")
    g.add_argument("--fork-n", type=_range, default=(2, 4), metavar="MIN:MAX",
                   help="shared-prefix: continuations of a forking request (2:4)")
    g = p.add_argument_group("pool and scheduler")
    g.add_argument("--pool-tokens", type=_positive, default=6144,
                   help="KV capacity in tokens, rounded up to whole pages (6144)")
    g.add_argument("--page-size", type=_positive, default=16, help="tokens per page (16)")
    g.add_argument("--host-pages", type=_non_negative, default=0, metavar="N",
                   help="a host tier of N host pages below the device pool (0: none); the demo then "
                        "runs twice, without and with it, and compares hit rate and tokens/s")
    g.add_argument("--layout", choices=("token", "paged"), default="token",
                   help="K/V buffer layout: [slots,H,D] or [pages,P,H,D] (token)")
    g.add_argument("--max-running", type=_positive, default=32,
                   help="most requests decoding at once (32)")
    g.add_argument("--admission", choices=("reserve", "optimistic"), default="reserve",
                   help="reserve: admit only if the request's final length fits (never preempts); "
                        "optimistic: admit if the prompt fits, preempt when the pool runs out")
    g = p.add_argument_group("model")
    g.add_argument("--hf", type=_path, metavar="PATH",
                   help="run a transformers Llama-architecture checkpoint (llama, mistral, qwen2) saved "
                        "with save_pretrained in PATH instead of the random model (needs kvpool[hf]; "
                        "the size options below are then ignored)")
    g.add_argument("--layers", type=_positive, default=4, help="decoder layers (4)")
    g.add_argument("--hidden", type=_positive, default=256, help="hidden size (256)")
    g.add_argument("--heads", type=_positive, default=8, help="attention heads (8)")
    g.add_argument("--kv-heads", type=_positive, default=2, help="key/value heads (grouped-query attention) (2)")
    g.add_argument("--vocab", type=_positive, default=2048, help="vocabulary size (2048)")
    g = p.add_argument_group("runtime")
    g.add_argument("--device", type=_device, default="cpu", help="cpu or cuda[:N] (cpu)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="weights and K/V dtype (float32 on cpu, bfloat16 on cuda)")
    g.add_argument("--cuda-graph", action="store_true",
                   help="run decode steps through kvpool.DecodeGraphRunner (captured on CUDA)")
    g.add_argument("--grad-mode", choices=GRAD_MODES, default="inference",
                   help="grad mode the demo runs under (inference)")
    g.add_argument("--threads", type=_threads, default=1,
                   help="torch CPU threads (1): this model's small matmuls gain little from more, "
                        "and lose badly when the cores are shared with other work")
    g.add_argument("--json", type=_path, metavar="PATH", help="also write the figures to PATH as JSON")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    from kvpool.progress import progress

    with progress(total=total, unit="tok", desc="generating", dynamic_ncols=True) as bar:
        yield bar


@contextlib.contextmanager
def _setup_errors(usage_error: Callable[[str], Any] | None) -> Iterator[None]:
    """Report what building the model, pool, requests and engine rejects (a ``ValueError``
    or ``KVPoolError`` naming the setting; an ``OSError`` for a ``--hf`` checkpoint that
    cannot be read) through ``usage_error`` (the parser's ``error``: a message and exit
    status 2); without one, let it propagate."""
    from kvpool.errors import KVPoolError

    try:
        yield
    except (ValueError, KVPoolError, OSError) as e:
        if usage_error is None:
            raise
        usage_error(str(e))


def _refuse_past_memory(what: str, nbytes: int, device: torch.device, fix: str) -> None:
    """Refuse ``nbytes`` of ``what`` past this machine's memory on a CPU run, naming the flags
    that size it (``fix``): kvpool's or torch's own refusal would name their parameters, and
    many small allocations would grow the process until the kernel kills it."""
    have = _args.host_memory_bytes()
    if device.type == "cpu" and nbytes > have:
        raise ValueError(f"cannot allocate {what}: {nbytes} bytes, more than this machine's {have} bytes of "
                         f"memory; {fix}")


def run(args: argparse.Namespace,
        usage_error: Callable[[str], Any] | None = None) -> tuple[dict[str, Any], list[float]]:
    """Build model, pool and requests under the chosen grad mode, serve them, audit.
    Settings they cannot be built with go to ``usage_error`` (``main`` passes ``parser.error``)."""
    import kvpool
    from kvpool.demo.engine import Engine
    from kvpool.demo.model import ModelConfig, build_model
    from kvpool.demo.report import figures
    from kvpool.demo.requests import synthetic_requests
    from kvpool.errors import KVPoolError
    from kvpool.out_of_memory import refuse_out_of_memory

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        message = f"--device {args.device} asked for, but torch sees no CUDA device"
        if usage_error is None:
            raise SystemExit(f"kvpool demo: {message}")
        usage_error(message)
    _check_request_memory(args, usage_error)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    page = args.page_size
    shared = args.workload == "shared-prefix"
    # The longest request's K/V, rounded up to whole pages, bounds the context length.
    longest_prompt = args.system_len[1] + args.prompt_len[1] if shared else args.prompt_len[1]
    max_ctx = -(-(longest_prompt + args.output_len[1]) // page) * page
    pool_pages = -(-args.pool_tokens // page)
    _check_allocator_bounds(args, max_ctx, usage_error)

    with grad_mode(args.grad_mode):
        with _setup_errors(usage_error):
            model = None
            if args.hf:
                from kvpool.demo.hf import load_hf_model
                try:
                    model = load_hf_model(args.hf, device=device, dtype=dtype, max_context=max_ctx,
                                          progress=not args.no_progress)
                except ImportError as e:  # no transformers: a setting this install cannot run
                    if usage_error is None:
                        raise
                    usage_error(str(e))
                except (ValueError, KVPoolError, OSError):
                    raise  # (_setup_errors words them)
                except Exception as e:  # noqa: BLE001 - a checkpoint the loaders refuse in their own types
                    if usage_error is None:
                        raise
                    text = " ".join(str(e).split())  # (one line: the usage error is one)
                    usage_error(f"--hf {args.hf!r}: cannot load this checkpoint ({type(e).__name__}: "
                                f"{text[:300] or 'no message'})")
                cfg = model.cfg
            else:
                cfg = ModelConfig(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers,
                                  heads=args.heads, kv_heads=args.kv_heads, max_positions=max_ctx,
                                  seed=args.seed)
            # The pool's own refusal names its parameters (num_pages, ...), not the demo's flags.
            kv_bytes = 2 * cfg.layers * (pool_pages + 1) * page * cfg.kv_heads * cfg.head_dim * dtype.itemsize
            _refuse_past_memory("the pool's K/V caches", kv_bytes, device,
                                "lower --pool-tokens" + ("" if args.hf else ", --layers, --kv-heads or --hidden"))
            # The pool before the random model: it names a page size or layer count it
            # cannot hold, where building the model would loop over them or fail in torch.
            pool = kvpool.KVPool(cfg.layers, cfg.kv_heads, cfg.head_dim, dtype=dtype, device=device,
                                 page_size=page, num_pages=pool_pages + 1,  # + the reserved page 0
                                 max_requests=args.max_running, max_context_len=max_ctx,
                                 layout=args.layout, kv_events=False,  # no router drains them here
                                 host_pages=args.host_pages)
            if model is None:
                # Many small tensors (one set per layer) never fail one allocation: the process
                # would grow until the kernel kills it, so compare with the memory first.
                nbytes, fix = model_bytes(cfg, dtype), "lower --layers, --hidden or --vocab"
                _refuse_past_memory("the demo model's weights", nbytes, device, fix)
                with refuse_out_of_memory("the demo model's weights", nbytes, device, fix):
                    model = build_model(cfg, device=device, dtype=dtype)
            if shared:
                from kvpool.demo.shared_prefix import PrefixEngine, shared_prefix_requests

                requests = shared_prefix_requests(
                    args.requests, vocab_size=cfg.vocab_size, system_prompts=args.system_prompts,
                    system_len=args.system_len, user_len=args.prompt_len, output_len=args.output_len,
                    fork_share=args.fork_share, fork_n=args.fork_n, seed=args.seed)
                engine = PrefixEngine(model, pool, max_running=args.max_running,
                                      use_cuda_graph=args.cuda_graph, admission=args.admission)
            else:
                requests = synthetic_requests(args.requests, vocab_size=cfg.vocab_size,
                                              prompt_len=args.prompt_len, output_len=args.output_len,
                                              seed=args.seed)
                engine = Engine(model, pool, max_running=args.max_running,
                                use_cuda_graph=args.cuda_graph, admission=args.admission)
            engine.check_fits(requests)  # here, so that a pool too small is a setup error too
        total = sum(r.max_new_tokens * getattr(r, "n", 1) for r in requests)
        with _progress(total, not args.no_progress) as bar:
            stats = engine.run(requests, progress=bar)
        # Every request closed, so every page must be back: verify the allocator agrees.
        pool.check()
        audit = kvpool.audit(model, pool)

    settings = {
        "requests": args.requests, "workload": args.workload, "prompt_len": list(args.prompt_len),
        "output_len": list(args.output_len), "seed": args.seed,
        "pool_tokens": pool_pages * page, "page_size": page, "layout": args.layout,
        "max_running": args.max_running, "admission": args.admission,
        "device": str(device), "dtype": str(dtype).replace("torch.", ""), "threads": args.threads,
        "cuda_graph": args.cuda_graph, "grad_mode": args.grad_mode, "model": cfg.to_dict(),
        "pages_in_use_at_end": int(pool.used_pages), "host_pages": args.host_pages,
        "open_requests_at_end": int(pool.open_requests),
    }
    fig = figures(stats, settings=settings, audit=audit)
    if args.host_pages:
        fig["host_tier"] = {"host_pages": args.host_pages, "host_hit_tokens": int(pool.host_hit_tokens),
                            "offload_bytes": int(pool.offload_bytes or 0), "load_bytes": int(pool.load_bytes or 0)}
    if shared:
        fig["prefix"] = engine.prefix.to_dict()
        settings.update(system_prompts=args.system_prompts, system_len=list(args.system_len),
                        fork_share=args.fork_share, fork_n=list(args.fork_n))
    return fig, stats.occupancy


def _tier_comparison(with_tier: dict[str, Any], without: dict[str, Any]) -> str:
    t = with_tier["host_tier"]
    lines = [f"  host tier ({t['host_pages']} host pages) vs none:"]
    if "prefix" in with_tier and "prefix" in without:
        lines.append(f"    hit rate       {100 * without['prefix']['hit_rate']:5.1f}% -> "
                     f"{100 * with_tier['prefix']['hit_rate']:5.1f}% of prompt tokens "
                     f"({t['host_hit_tokens']} from the host)")
    lines.append(f"    prefilled      {without['prefill_tokens']} -> {with_tier['prefill_tokens']} tokens")
    lines.append(f"    tokens/s       {without['tokens_per_s']:.0f} -> {with_tier['tokens_per_s']:.0f}")
    lines.append(f"    moved          {t['offload_bytes'] / 2**20:.2f} MiB offloaded, "
                 f"{t['load_bytes'] / 2**20:.2f} MiB loaded")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # A shell leaves `~` alone in `--json=~/x` and in quoted paths.
    for name in ("json", "hf"):
        if getattr(args, name):
            setattr(args, name, os.path.expanduser(getattr(args, name)))
    # Checked before the run, which may take minutes, rather than failing after it.
    if args.json and os.path.isdir(args.json):
        parser.error(f"--json: {args.json!r} is a directory; give a file path")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json: the directory of {args.json!r} does not exist")
    if args.json:
        from kvpool.bench.cli import check_outputs

        problem = check_outputs(args, [("--json", args.json)])
        if not problem and os.path.exists(args.json) and not os.access(args.json, os.W_OK):
            problem = f"--json: {args.json!r} exists and is not writable; give a writable path"
        if problem:
            parser.error(problem.replace("give --out a writable directory", "give --json a writable path"))
    if args.hf and not os.path.isdir(args.hf):
        parser.error(f"--hf: {args.hf!r} is not a directory (a save_pretrained checkpoint)")
    from kvpool.demo.report import render

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        fig, occupancy = run(args, parser.error)
        # With a host tier: the same run without it, for the comparison.
        without = None
        if args.host_pages:
            without = run(argparse.Namespace(**{**vars(args), "host_pages": 0}), parser.error)[0]
    finally:
        torch.set_num_threads(threads)  # process-wide: give the caller its setting back
    print(render(fig, occupancy))
    if without is not None:
        fig["without_host_tier"] = {k: without[k] for k in ("tokens_per_s", "prefill_tokens") if k in without}
        if "prefix" in without:
            fig["without_host_tier"]["prefix"] = without["prefix"]
        print(_tier_comparison(fig, without))
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(fig, f, indent=2)
        except OSError as e:  # (made unwritable during the run, or a device that is full)
            parser.exit(1, f"kvpool demo: error: cannot write --json {args.json!r}: {e}\n")
        print(f"  figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
