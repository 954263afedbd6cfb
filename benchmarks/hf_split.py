"""Where ``generate``'s host time goes with ``KVPoolCache`` against ``DynamicCache``.

Same model and settings as ``python -m kvpool.bench overhead --sections hf``
(``kvpool.bench.hf_generate``); each run's thread-CPU time is split into the
cache's ``update`` calls, the attention function (transformers' ``sdpa``, which
reads the K/V ``update`` returned) and the rest of the model, by wrapping the
two with ``time.thread_time``. Medians over alternated rounds, µs per new token
(the prompt step included), one torch thread.

With ``--parts``, inside ``KVPoolCache.update`` it also reports its parts (included in its
figure, which their own timers then inflate a little): the step's start (``begin_step``:
the pool's extend, the page table and the flushes it makes), the pool stores (``store``),
the K/V handed to attention (``kv``: layer-buffer copies or gathers) and ``flush``. With ``--device cuda`` (model, prompts and pool on the GPU) thread-CPU time
is the host time of the launches, which is what the split is for there; the GPU session
runs it (``hf_split`` section).

As in the overhead bench, the pool also serves batch-8 runs between rounds, so the
free pages the measured batch takes are out of order and a single row's pages are not
consecutive: its K/V come from the layer buffers. ``--fresh-pool`` measures a pool that
serves only the measured batch instead (one row then reads the pool's pages in place).

    PYTHONPATH=python python benchmarks/hf_split.py --batch 1 --rounds 10 [--device cuda] [--out split.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch


def main(argv: list[str] | None = None) -> None:
    from call_profile import profile_calls

    from kvpool.bench.cli import count
    from kvpool.bench.hf_generate import HFSettings

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=count(1), default=1)
    ap.add_argument("--rounds", type=count(1), default=10)
    ap.add_argument("--prompt-len", type=count(1), default=HFSettings.prompt_len)
    ap.add_argument("--new-tokens", type=count(1), default=HFSettings.new_tokens)
    ap.add_argument("--fresh-pool", action="store_true",
                    help="a pool for the measured batch alone, its free pages in order")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--parts", action="store_true", help="also time the parts of KVPoolCache.update")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then profile KVPoolCache.update in one generate (cProfile) and print its N "
                         "costliest functions by own time and by time inside")
    ap.add_argument("--out", default=None, help="also write the table as JSON here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import DynamicCache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from kvpool.bench.hf_generate import build_model, run_once
    from kvpool.integrations import _pages, _requests
    from kvpool.integrations.transformers import KVPoolCache, pool_for_model
    from kvpool.pool import KVPool

    parts = ("begin_step", "store", "kv", "flush") if a.parts else ()
    spent = dict.fromkeys(("attention", "update", *parts), 0.0)

    def timed(name: str, f: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t = time.thread_time()
            try:
                return f(*args, **kwargs)
            finally:
                spent[name] += time.thread_time() - t
        return call

    ALL_ATTENTION_FUNCTIONS["sdpa"] = timed("attention", ALL_ATTENTION_FUNCTIONS["sdpa"])
    for cls in (DynamicCache, KVPoolCache):
        cls.update = timed("update", cls.update)  # type: ignore[method-assign]
    # The parts of KVPoolCache.update (BatchRequests takes the pool's store when it is made).
    if a.parts:
        _requests.BatchRequests.begin_step = timed(  # type: ignore[method-assign]
            "begin_step", _requests.BatchRequests.begin_step)
        _requests.BatchRequests.flush = timed("flush", _requests.BatchRequests.flush)  # type: ignore[method-assign]
        KVPool._store_bhtd = timed("store", KVPool._store_bhtd)  # type: ignore[method-assign]
        _pages.StepPages.kv = timed("kv", _pages.StepPages.kv)  # type: ignore[method-assign]

    s = HFSettings(batches=(a.batch,), prompt_len=a.prompt_len, new_tokens=a.new_tokens, device=a.device)
    model = build_model(s)
    per_row = -(-(s.prompt_len + s.new_tokens) // s.page_size) * s.page_size
    top = a.batch if a.fresh_pool else max(a.batch, 8)
    pool = pool_for_model(model, max_tokens=top * per_row + 64, page_size=s.page_size,
                          max_requests=top, max_context_len=s.prompt_len + s.new_tokens)
    g = torch.Generator().manual_seed(s.seed)
    ids = torch.randint(3, s.vocab, (a.batch, s.prompt_len), generator=g).to(a.device)
    other = torch.randint(3, s.vocab, (8, s.prompt_len), generator=g).to(a.device)
    runs: dict[str, list[tuple[float, ...]]] = {"dynamic": [], "kvpool": []}
    for r in range(a.rounds + 1):  # round 0 warms up
        for kind in (("dynamic", "kvpool") if r % 2 == 0 else ("kvpool", "dynamic")):
            spent.update(dict.fromkeys(spent, 0.0))
            if kind == "dynamic":
                _, cpu, _ = run_once(model, ids, DynamicCache(config=model.config), s.new_tokens)
            else:
                with KVPoolCache(pool) as cache:
                    _, cpu, _ = run_once(model, ids, cache, s.new_tokens)
            if r:
                runs[kind].append((cpu, spent["attention"], spent["update"], *(spent[p] for p in parts)))
        if not a.fresh_pool:  # the bench's batch-8 runs leave the pool's free pages out of order
            with KVPoolCache(pool) as cache:
                run_once(model, other, cache, 2)
    def generate_once() -> None:
        with KVPoolCache(pool) as cache:
            run_once(model, ids, cache, s.new_tokens)

    profile = profile_calls(KVPoolCache, "update", generate_once, a.profile) if a.profile else {}
    kind_of_pool = "a fresh pool" if a.fresh_pool else "a pool that also serves batch 8"
    print(f"batch {a.batch}, prompt {s.prompt_len}, {s.new_tokens} new, {a.rounds} alternated rounds, {kind_of_pool}, "
          f"{a.device}, thread-CPU µs per new token")
    head = "".join(f" {p} |" for p in parts)
    print("| cache | total | attention | cache.update | rest |" + (" update:" + head if parts else ""))
    print("|---|---|---|---|---|" + "---|" * len(parts))
    table = {}
    for kind, v in runs.items():
        med = [statistics.median(x[i] for x in v) * 1e6 / s.new_tokens for i in range(3 + len(parts))]
        total, attn, upd = med[:3]
        table[kind] = {"total": total, "attention": attn, "update": upd, "rest": total - attn - upd,
                       **({p: m for p, m in zip(parts, med[3:])} if kind == "kvpool" else {})}
        shown = "".join(f" {m:.0f} |" if kind == "kvpool" else " - |" for m in med[3:])
        print(f"| {kind} | {total:.0f} | {attn:.0f} | {upd:.0f} | {total - attn - upd:.0f} |{shown}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"settings": {"batch": a.batch, "rounds": a.rounds, "prompt_len": s.prompt_len,
                                    "new_tokens": s.new_tokens, "fresh_pool": a.fresh_pool, "device": a.device,
                                    "parts": a.parts},
                       "unit": "thread-CPU us per new token", "results": table, "profile": profile}, fh, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
