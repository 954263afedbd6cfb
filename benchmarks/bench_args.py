"""Host µs per call of the argument forms a decode step passes: int64 numpy
handles, CPU torch handles and counts, with and without `table=` / `out=`.

    python benchmarks/bench_args.py                      # the installed/PYTHONPATH build
    python benchmarks/bench_args.py --export capsule     # torch read through _to_dlpack
    python benchmarks/bench_args.py --export numpy       # torch read through numpy.asarray
    python benchmarks/bench_args.py --against OLD/_core.abi3.so

`--export` takes torch's C exchange API (and with `numpy` also `_to_dlpack`)
away before the first tensor arrives, as an older torch would. `--against`
loads a second build of the extension into the same process and alternates
the two call by call, which keeps a shared machine's drift out of the
comparison (two processes run minutes apart can differ by 20%).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import numpy as np
import torch


def load(path: str):
    spec = importlib.util.spec_from_file_location("_core", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cases(table: np.ndarray, out: np.ndarray) -> dict:
    return {
        "extend(numpy handles, 1)": lambda a, h, th: a.extend(h, 1),
        "extend(numpy handles, 1, table, out)": lambda a, h, th: a.extend(h, 1, table=table, out=out),
        "extend(torch handles, 1)": lambda a, h, th: a.extend(th, 1),
        "extend(torch handles, torch int32 counts)": lambda a, h, th: a.extend(th, th_counts),
        "lengths(numpy handles)": lambda a, h, th: a.lengths(h),
        "lengths(torch handles)": lambda a, h, th: a.lengths(th),
        "open(8) + close": lambda a, h, th: a.close(a.open(8)),
    }


th_counts = torch.ones(256, dtype=torch.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", choices=["view", "capsule", "numpy"], default="view")
    ap.add_argument("--against", help="another build's _core .so, alternated in the same process")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    if args.export != "view":
        del torch._C._dlpack_exchange_api
    if args.export == "numpy":
        del torch._C._to_dlpack
    import kvpool._core

    builds = {"this": kvpool._core}
    if args.against:
        builds["against"] = load(args.against)
    table = np.zeros((512, 4096), np.int32)
    out = np.empty(4096, np.int64)
    pools = {}
    for name, mod in builds.items():
        a = mod.SlotAllocator(1 << 16, page_size=16, max_requests=512, max_context_len=4096)
        h = a.open(256)
        pools[name] = (a, h, torch.from_numpy(h.copy()))
    res: dict = {}
    for rep in range(args.reps):
        for case, fn in cases(table, out).items():
            order = list(pools) if rep % 2 else list(pools)[::-1]
            for name in order:
                a, h, th = pools[name]
                a.truncate(h, 0)
                t0 = time.perf_counter()
                for _ in range(500):
                    fn(a, h, th)
                res.setdefault((case, name), []).append((time.perf_counter() - t0) / 500 * 1e6)
    print(f"torch read path: {args.export}; median (min) µs per call over {args.reps} rounds of 500")
    for case in cases(table, out):
        cells = [f"{n} {statistics.median(res[(case, n)]):.3f} ({min(res[(case, n)]):.3f})" for n in pools]
        print(f"{case:44s} " + " | ".join(cells))


if __name__ == "__main__":
    main()
