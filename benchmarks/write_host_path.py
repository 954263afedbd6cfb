"""Host time of a Triton pool's ``KVPool.write`` before its launch, measured on the CPU.

A CUDA pool's eager ``write`` is Python in front of one store launch, paid once per layer per
step (issue 32's GPU target: write <= 15 µs of host time a call). Without a GPU that Python
can still be timed: a CPU pool under ``TRITON_INTERPRET=1`` takes the same kernel path, and
with its slots treated as device slots (``_device_slots_fast``, as on CUDA, where slots are
not read back) and the launch replaced by a counter, what is left is what a CUDA pool's host
pays before Triton's launcher runs. Three figures, alternated in one run, one thread:

- ``pool``: ``pool.write(layer, slots, k, v)`` as a pool makes it (``kernels.layer_stores``);
- ``generic``: the same pool through ``kernels.ops.store_rows`` (the path every write took
  before ``LayerStores``, and still the path of ``kernels.store_kv`` and of torch.compile);
- ``bare``: two ``index_copy_`` into the same caches (torch's own host time for a store).

    PYTHONPATH=python python benchmarks/write_host_path.py [--rows 1,64] [--json out.json]

Figures for a GPU box's CPU differ (faster cores, plus the launcher itself, 3-6 µs); the
ratio between ``pool`` and ``generic`` is what this measures.
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
from kvpool.kernels import layer_stores, store  # noqa: E402


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _rows(text: str) -> list[int]:
    return [_positive(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=_rows, default=[1, 64], help="rows a write stores (comma-separated)")
    ap.add_argument("--rounds", type=_positive, default=7, help="alternated rounds (median reported)")
    ap.add_argument("--number", type=_positive, default=5000, help="calls per timing")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": "host µs of KVPool.write before the launch (Triton path, CPU, launch stubbed)",
                       "torch": torch.__version__, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
