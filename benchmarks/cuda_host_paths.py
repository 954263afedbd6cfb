"""Host time a CUDA pool's per-step calls spend before their launches, measured on the CPU.

``write``: a CUDA pool's eager ``write`` is Python in front of one store launch, paid once per layer per
step (issue 32's GPU target: write <= 15 µs of host time a call). Without a GPU that Python
can still be timed: a CPU pool under ``TRITON_INTERPRET=1`` takes the same kernel path, and
with its slots treated as device slots (``_device_slots_fast``, as on CUDA, where slots are
not read back) and the launch replaced by a counter, what is left is what a CUDA pool's host
pays before Triton's launcher runs. Three figures, alternated in one run, one thread:

- ``pool``: ``pool.write(layer, slots, k, v)`` as a pool makes it (``kernels.layer_stores``);
- ``generic``: the same pool through ``kernels.ops.store_rows`` (the path every write took
  before ``LayerStores``, and still the path of ``kernels.store_kv`` and of torch.compile);
- ``bare``: two ``index_copy_`` into the same caches (torch's own host time for a store).

``table``: the table write of a CUDA pool's ``extend`` (once a step), from its packed device
array to the launcher, both launches replaced as above: ``kept`` (``launch_packed_kept``: the
parts' addresses, no views) against ``views`` (``PackedExtend.parse``'s five views and
``launch_write_req_to_token``, the path of a key's first launch), at 1 and 64 requests.

    PYTHONPATH=python python benchmarks/cuda_host_paths.py [--sections write,table] [--rows 1,64] [--json out.json]

Figures for a GPU box's CPU differ (faster cores, plus the launcher itself, 3-6 µs); the
ratios in one run are what this measures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import timeit

os.environ["TRITON_INTERPRET"] = "1"  # before kvpool.kernels is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvpool  # noqa: E402
from kvpool.kernels import layer_stores, req_table, store  # noqa: E402
from kvpool.packed import PackedExtend, pack, segment_len  # noqa: E402


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _rows(text: str) -> list[int]:
    return [_positive(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=_rows, default=[1, 64], help="rows a write stores, requests an extend grows (comma-separated)")
    ap.add_argument("--rounds", type=_positive, default=7, help="alternated rounds (median reported)")
    ap.add_argument("--number", type=_positive, default=5000, help="calls per timing")
    ap.add_argument("--sections", type=_sections, default=["write", "table"], help="write,table")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = {}
    if "write" in args.sections:
        out["write"] = _write(args)
    if "table" in args.sections:
        out["table"] = _table(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": "host µs before the launch (CPU, launches stubbed)", "torch": torch.__version__,
                       **out}, f, indent=1)


def _sections(text: str) -> list[str]:
    got = text.split(",")
    bad = [x for x in got if x not in ("write", "table")]
    if bad or not got:
        raise argparse.ArgumentTypeError(f"unknown section(s) {bad}: pick from write,table")
    return got


def _write(args: argparse.Namespace) -> dict:
    launches = [0]

    def counted(*_a, **_k) -> None:
        launches[0] += 1

    # The launch alone is replaced (both paths call it last, with everything computed).
    store.launch_planned = counted
    layer_stores.launch_planned = counted
    out = {}
    for layout, page in (("token", 1), ("paged", 16)):
        for rows in args.rows:
            pool = kvpool.KVPool(4, 8, 128, dtype=torch.bfloat16, num_pages=256, page_size=page,
                                 max_requests=rows, max_context_len=64, layout=layout)
            assert pool._row_kernel, "the interpreter's kernel path"
            pool._device_slots_fast = True  # slots taken as device slots are on CUDA (not read back)
            step = pool.extend(pool.open(rows), np.ones(rows, dtype=np.int64))
            slots = step.out_cache_loc
            k = torch.randn(rows, 8, 128, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            kc, vc = pool._row_caches[1]
            idx = slots.long()
            stores = pool._row_stores

            def pool_write() -> None:
                pool.write(1, slots, k, v)

            def bare() -> None:
                kc.index_copy_(0, idx, k)
                vc.index_copy_(0, idx, v)

            def timed(fn, generic: bool = False) -> float:
                pool._row_stores = None if generic else stores
                try:
                    return timeit.timeit(fn, number=args.number) / args.number * 1e6
                finally:
                    pool._row_stores = stores

            runs: dict[str, list[float]] = {"pool": [], "generic": [], "bare": []}
            for _ in range(args.rounds):
                runs["pool"].append(timed(pool_write))
                runs["generic"].append(timed(pool_write, generic=True))
                runs["bare"].append(timed(bare))
            med = {name: statistics.median(xs) for name, xs in runs.items()}
            row = f"{layout} x{rows}"
            out[row] = {**{f"{n}_us": round(x, 2) for n, x in med.items()},
                        "pool_over_generic": round(med["pool"] / med["generic"], 3)}
            print(f"{row:<10} write {med['pool']:6.2f} µs  generic path {med['generic']:6.2f} µs  "
                  f"({med['pool'] / med['generic']:.2f}x)  bare index_copy_ pair {med['bare']:6.2f} µs")
    assert launches[0] > 0
    return out


def _table(args: argparse.Namespace) -> dict:
    # Both stop where the launcher would be called: the generic path at launch_planned, the kept
    # one at CompiledLaunch.launch_kept (which then finds the kernel kept, as in steady state).
    req_table.launch_planned = lambda *a, **k: None
    req_table._LAUNCH.launch_kept = lambda *a, **k: True
    table = torch.zeros((256, 4096), dtype=torch.int32)
    out = {}
    for b in args.rows:
        counts = np.ones(b, dtype=np.int64)
        arr, _ = pack([np.arange(b), np.arange(b), counts, np.arange(b), np.arange(b)])
        packed = torch.from_numpy(arr)
        seg = segment_len(b)
        req_table._PLANS.clear()
        p = PackedExtend.parse(packed, b)
        # (the first launch of the key, which keeps its plan)
        req_table.launch_planned = lambda launch, kernel, plans, key, make, *a: plans.setdefault(key, make())
        req_table.launch_write_req_to_token(table, p.rows, p.starts, p.counts, p.slots, p.offsets)
        req_table.launch_planned = lambda *a, **k: None
        assert req_table.launch_packed_kept(table, packed, b, seg), "the kept path found its plan"

        def kept() -> None:
            req_table.launch_packed_kept(table, packed, b, seg)

        def views() -> None:
            q = PackedExtend.parse(packed, b)
            req_table.launch_write_req_to_token(table, q.rows, q.starts, q.counts, q.slots, q.offsets)

        runs: dict[str, list[float]] = {"kept": [], "views": []}
        for _ in range(args.rounds):
            for name, fn in (("kept", kept), ("views", views)):
                runs[name].append(timeit.timeit(fn, number=args.number) / args.number * 1e6)
        med = {name: statistics.median(xs) for name, xs in runs.items()}
        out[f"extend x{b}"] = {**{f"{n}_us": round(x, 2) for n, x in med.items()},
                               "kept_over_views": round(med["kept"] / med["views"], 3)}
        print(f"table of extend x{b:<4} kept launch {med['kept']:6.2f} µs  views {med['views']:6.2f} µs  "
              f"({med['kept'] / med['views']:.2f}x)")
    return out


if __name__ == "__main__":
    main()
