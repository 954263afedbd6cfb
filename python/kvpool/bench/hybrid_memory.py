"""``python -m kvpool.bench hybrid-memory``: device bytes per request and the most concurrent requests at
a long context, layer groups (full + sliding window) against every layer in full.

The model shape defaults to Gemma-3 27B's (Hugging Face config: 62 layers, every 6th full attention
and the other five a 1024-token sliding window, 16 KV heads of dim 128, bf16): 10 full and 52 sliding
layers. Nothing is computed from a formula alone: each pool is a real ``GroupedAllocator`` whose pages
are sized to the device budget, and requests are driven into it as an engine with chunked prefill
drives them (prefill in ``--chunk`` token steps and one decode step, one request after the other)
until one no longer fits. The figures are what the pool then holds:

- bytes per request: every group's held pages times its page's bytes (all its layers' K and V),
  over the requests, in the decode state (a sliding group holds the window and the page being
  written; during a prefill chunk it holds the chunk and the window before it);
- concurrent requests: how many reached the context and decoded a token.

The grouped pool splits the budget between its groups by what a request needs from each in the
decode state, and leaves the sliding group room for one prefill chunk on top (``split``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from kvpool.bench import cli
from kvpool.bench.report import md_table, output_path, write_json

TARGET_RATIO = 0.25  # grouped bytes per request / all-full bytes per request


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's KV shape: which layers are full attention, which a sliding window."""

    layers: int
    full_every: int  # layer i is full attention when (i + 1) % full_every == 0 (Gemma 3: 6)
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    window: int  # tokens a sliding layer attends to, itself included (Hugging Face sliding_window)

    @property
    def full_layers(self) -> int:
        return self.layers // self.full_every

    @property
    def sliding_layers(self) -> int:
        return self.layers - self.full_layers

    @property
    def token_layer_bytes(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


def _pool(groups: list[dict[str, Any]], max_requests: int, max_context_len: int) -> Any:
    import kvpool

    return kvpool.GroupedAllocator(groups, max_requests, max_context_len, hash_seed=0, handle_seed=0,
                                   kv_events=False)


def fill(pool: Any, context: int, chunk: int, max_requests: int) -> dict[str, Any]:
    """Admits requests one at a time (chunked prefill to ``context`` tokens, then one decode step)
    until one no longer fits; returns the count and each group's held and peak pages."""
    import kvpool

    n_groups = pool.num_groups
    peak = [0] * n_groups
    done: list[int] = []
    while len(done) < max_requests:
        h = pool.open(1)
        try:
            for start in range(0, context, chunk):
                pool.extend(h, min(chunk, context - start))
                peak = [max(p, pool.used_pages(g)) for g, p in enumerate(peak)]
            # Its first decode step, the next one an engine runs: a sliding group lets go of the
            # last chunk's pages that the window has passed.
            pool.extend(h, 1)
        except kvpool.PoolExhaustedError:
            pool.close(h)
            break
        done.append(int(h[0]))
    pool.check()
    return {"requests": len(done), "held": [pool.used_pages(g) for g in range(n_groups)], "peak": peak}


def page_bytes(shape: Shape, kind: str, page_size: int) -> int:
    layers = {"full": shape.full_layers, "sliding": shape.sliding_layers, "all": shape.layers}[kind]
    return page_size * layers * shape.token_layer_bytes


def probe(shape: Shape, context: int, chunk: int, page_size: int) -> dict[str, int]:
    """One request's pages in each group of the grouped pool: held in the decode state and at its
    prefill's peak (a pool that surely fits it)."""
    pages = -(-(context + 1) // page_size) + 2
    pool = _pool([{"kind": "full", "num_pages": pages, "page_size": page_size},
                  {"kind": "sliding", "num_pages": pages, "page_size": page_size, "window": shape.window}],
                 1, context + 1)
    got = fill(pool, context, chunk, 1)
    return {"full": got["held"][0], "sliding": got["held"][1], "sliding_peak": got["peak"][1]}


def split(shape: Shape, budget: int, need: dict[str, int], page_size: int) -> tuple[int, int]:
    """(full pages, sliding pages) for ``budget`` bytes: as many requests' decode-state needs as fit,
    after room for one prefill chunk above its decode state in the sliding group, with what is left
    over shared in the same proportion (page 0 of each group is reserved and counted)."""
    fb, sb = page_bytes(shape, "full", page_size), page_bytes(shape, "sliding", page_size)
    per_request = need["full"] * fb + need["sliding"] * sb
    transient = (need["sliding_peak"] - need["sliding"]) * sb
    left = budget - transient - fb - sb
    share = need["full"] * fb / per_request
    full = 1 + int(left * share // fb)
    sliding = (budget - full * fb) // sb
    return full, int(sliding)


def budget_problem(shape: Shape, budgets: list[int], need: dict[str, int], page_size: int) -> str | None:
    """Why a budget's pools cannot be built (None: every one can), naming the flags: each pool needs
    a usable page besides page 0 in every group, and at most the allocator's MAX_PAGES pages."""
    from kvpool._core import MAX_PAGES

    for budget in budgets:
        full, sliding = split(shape, budget, need, page_size)
        pages = {"full": full, "sliding": sliding, "all-full": budget // page_bytes(shape, "all", page_size)}
        small = [k for k, n in pages.items() if n < 2]
        if small:
            kind = small[0]
            each = page_bytes(shape, "all" if kind == "all-full" else kind, page_size)
            return (f"--budgets {budget} is too small at this shape (--layers, --kv-heads, --head-dim, "
                    f"--dtype-bytes, --page-size): the {kind} pool gets {max(pages[kind], 0)} pages of {each} bytes "
                    "and needs 2 (page 0 is reserved); give a larger --budgets or a smaller shape")
        big = [k for k, n in pages.items() if n > MAX_PAGES]
        if big:
            return (f"--budgets {budget} makes the {big[0]} pool {pages[big[0]]} pages; kvpool's allocator takes "
                    f"at most {MAX_PAGES}: give a smaller --budgets or a larger --page-size")
    return None


def run(shape: Shape, budgets: list[int], context: int, chunk: int, page_size: int,
        max_requests: int, need: dict[str, int] | None = None) -> dict[str, Any]:
    """``need``: ``probe``'s answer, when the caller has it already."""
    need = need or probe(shape, context, chunk, page_size)
    fb, sb, ab = (page_bytes(shape, k, page_size) for k in ("full", "sliding", "all"))
    rows: list[dict[str, Any]] = []
    for budget in budgets:
        full_pages, sliding_pages = split(shape, budget, need, page_size)
        grouped = fill(_pool([{"kind": "full", "num_pages": full_pages, "page_size": page_size},
                              {"kind": "sliding", "num_pages": sliding_pages, "page_size": page_size,
                               "window": shape.window}], max_requests, context + 1),
                       context, chunk, max_requests)
        all_pages = budget // ab
        everything = fill(_pool([{"kind": "full", "num_pages": all_pages, "page_size": page_size}],
                                max_requests, context + 1), context, chunk, max_requests)
        g_bytes = grouped["held"][0] * fb + grouped["held"][1] * sb
        a_bytes = everything["held"][0] * ab
        # None where no request fits the budget: bytes per request is undefined there (not NaN, which
        # printed as 'nan' and failed the target by comparison alone).
        g_per = g_bytes / grouped["requests"] if grouped["requests"] else None
        a_per = a_bytes / everything["requests"] if everything["requests"] else None
        rows.append({
            "budget_bytes": budget, "full_pages": full_pages, "sliding_pages": sliding_pages,
            "all_full_pages": all_pages,
            "grouped": {"requests": grouped["requests"], "bytes_per_request": g_per,
                        "held_pages": grouped["held"], "peak_pages": grouped["peak"]},
            "all_full": {"requests": everything["requests"], "bytes_per_request": a_per,
                         "held_pages": everything["held"]},
            "bytes_ratio": g_per / a_per if g_per is not None and a_per is not None else None, "requests_ratio": (grouped["requests"] / everything["requests"]
                                                              if everything["requests"] else None),
        })
    per_request: dict[str, Any] = {"full_pages": need["full"], "sliding_pages": need["sliding"],
                   "sliding_peak_pages": need["sliding_peak"],
                   "grouped_bytes": need["full"] * fb + need["sliding"] * sb,
                   "all_full_bytes": -(-(context + 1) // page_size) * ab}
    per_request["ratio"] = per_request["grouped_bytes"] / per_request["all_full_bytes"]
    return {"per_request": per_request, "budgets": rows, "target_ratio": TARGET_RATIO,
            "meets_target": per_request["ratio"] <= TARGET_RATIO
            and all(r["bytes_ratio"] <= TARGET_RATIO for r in rows if r["bytes_ratio"] is not None)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context", type=cli.parse_size, default=32 << 10, help="tokens per request (default 32K)")
    p.add_argument("--window", type=cli.count(1), default=1024,
                   help="sliding window, the token itself included (1024)")
    p.add_argument("--layers", type=cli.count(2), default=62, help="layers (62: Gemma-3 27B)")
    p.add_argument("--full-every", type=cli.count(2), default=6,
                   help="every N-th layer is full attention, 2 <= N <= --layers (6: 5 sliding : 1 full)")
    p.add_argument("--kv-heads", type=cli.count(1), default=16, help="KV heads (16)")
    p.add_argument("--head-dim", type=cli.count(1), default=128, help="head dim (128)")
    p.add_argument("--dtype-bytes", type=cli.count(1), default=2, help="bytes per element (2: bf16)")
    p.add_argument("--page-size", type=cli.count(1), default=16, help="tokens per page, every group (16)")
    p.add_argument("--chunk", type=cli.count(1), default=2048, help="prefill chunk in tokens (2048)")
    p.add_argument("--budgets", type=cli.list_of(cli.parse_size), default=cli.list_of(cli.parse_size)("20G,80G"),
                   help="device bytes for the KV cache (default 20G,80G: what an 80 GB and a 141 GB GPU keep "
                        "after a 27B model's bf16 weights, roughly)")
    p.add_argument("--max-requests", type=cli.count(1), default=4096, help="rows of each pool (4096)")
    cli.add_out_argument(p)
    p.add_argument("--json", default="hybrid-memory.json", help="JSON output file, under --out ('' for none)")


def main(args: argparse.Namespace, machine: dict[str, Any]) -> int:
    if args.full_every > args.layers:
        raise cli.UsageError(f"--full-every {args.full_every} leaves no full-attention layer among --layers "
                             f"{args.layers}; give --full-every <= --layers")
    from kvpool._core import MAX_CONTEXT_LEN, MAX_REQUESTS, InvalidArgumentError

    # The allocator's bounds, by flag, before any pool is built (each pool holds --context + 1 tokens).
    if args.context + 1 > MAX_CONTEXT_LEN:
        raise cli.UsageError(f"--context {args.context} is longer than kvpool's allocator takes; give --context "
                             f"in [1, {MAX_CONTEXT_LEN - 1}]")
    if args.max_requests > MAX_REQUESTS:
        raise cli.UsageError(f"--max-requests {args.max_requests} is more than kvpool's allocator takes; give "
                             f"--max-requests in [1, {MAX_REQUESTS}]")
    shape = Shape(args.layers, args.full_every, args.kv_heads, args.head_dim, args.dtype_bytes, args.window)
    need = probe(shape, args.context, args.chunk, args.page_size)
    problem = budget_problem(shape, args.budgets, need, args.page_size)
    if problem:
        raise cli.UsageError(problem)
    try:
        out = run(shape, args.budgets, args.context, args.chunk, args.page_size, args.max_requests, need)
    except InvalidArgumentError as e:
        # Shapes within the bounds whose metadata this machine cannot hold: the core says so, typed,
        # and the flags that size the pools are the way out.
        raise cli.UsageError(f"--budgets {','.join(map(str, args.budgets))} / --max-requests {args.max_requests}: "
                             f"{e}") from None
    gib = 1 << 30
    pr = out["per_request"]
    print(f"{shape.layers} layers ({shape.full_layers} full, {shape.sliding_layers} sliding, window "
          f"{shape.window}), {shape.kv_heads} KV heads x {shape.head_dim}, {shape.dtype_bytes} B; page "
          f"{args.page_size}, context {args.context}, prefill chunk {args.chunk}")
    print(f"one request in the decode state: full {pr['full_pages']} pages, sliding {pr['sliding_pages']} pages "
          f"(peak {pr['sliding_peak_pages']} during a prefill chunk)")
    rows = [["one request", "", f"{pr['grouped_bytes'] / gib:.3f}", f"{pr['all_full_bytes'] / gib:.3f}",
             f"{pr['ratio']:.3f}", "", ""]]
    def per(x: float | None, spec: str = ".3f") -> str:
        return "none fits" if x is None else f"{x:{spec}}"

    for r in out["budgets"]:
        rows.append([f"{r['budget_bytes'] / gib:g} GiB pool", f"{r['full_pages']} + {r['sliding_pages']}",
                     per(r["grouped"]["bytes_per_request"] and r["grouped"]["bytes_per_request"] / gib),
                     per(r["all_full"]["bytes_per_request"] and r["all_full"]["bytes_per_request"] / gib),
                     "n/a" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:.3f}", str(r["grouped"]["requests"]),
                     str(r["all_full"]["requests"])])
    print(md_table(["", "grouped pages (full + sliding)", "grouped GiB/request", "all-full GiB/request",
                    "ratio", "grouped requests", "all-full requests"], rows))
    ok = "meets" if out["meets_target"] else "MISSES"
    unmeasured = [f"{r['budget_bytes'] / gib:g} GiB" for r in out["budgets"] if r["bytes_ratio"] is None]
    skipped = (f" (over one request and the budgets where both pools hold one; at {', '.join(unmeasured)} "
               "a 'none fits' pool leaves the ratio n/a)") if unmeasured else ""
    print(f"bytes per request, grouped / all full: target <= {TARGET_RATIO}: {ok} target{skipped}")
    if args.json:
        path = output_path(args.out, args.json)
        write_json(path, {"benchmark": "hybrid-memory", "settings": cli.settings(args), "machine": machine,
                          "shape": dataclasses.asdict(shape), **out})
        print(f"wrote {path}")
    return 0


__all__ = ["Shape", "add_arguments", "budget_problem", "fill", "main", "probe", "run", "split"]
