"""One first burst, run as a script in a fresh process: ``python .../first_burst.py SLOTS PAGE PROMPTS [control]``.

Prints one JSON object: the construction time of a ``SlotAllocator`` of SLOTS
slots at page size PAGE (256 rows, max_context_len 4096), the first admission
of 256 prompts into it (PROMPTS ``mixed``: 64-4096 tokens, 528K in all;
``2048``: 256 x 2048) with a resident request-to-token table, in ns per token
and minor page faults, and the same admission on the same allocator once two
have come and gone ("warm"), both after the same cache flush (twice the
last-level cache written, at least 64 MiB: a smaller flush leaves the warm
admission's metadata in a large L3, and the comparison measures the cache
instead of the pool).

A fresh process because a server builds its pool once, at start-up: in a
process that has already freed large arrays, the C allocator may hand a new
pool recycled memory, mapped and zeroed at construction, and its first burst
looks warm. The extension is loaded on its own, without ``import kvpool``
(which imports torch, seconds of start-up per run).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import resource
import sys
import time

import numpy as np

ROWS, CTX = 256, 4096


def mixed_prompts() -> np.ndarray:
    """256 lengths uniform in [64, 4096] (seed 0), scaled to about 528K tokens."""
    c = np.random.default_rng(0).integers(64, 4097, ROWS)
    return (c * (528 * 1024 / c.sum())).astype(np.int64)


def prompts(kind: str) -> np.ndarray:
    return mixed_prompts() if kind == "mixed" else np.full(ROWS, int(kind), dtype=np.int64)


def _load_core():
    """``kvpool._core`` from the file next to this package, without importing kvpool."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = next(os.path.join(here, f) for f in os.listdir(here) if f.startswith("_core") and f.endswith(".so"))
    loader = importlib.machinery.ExtensionFileLoader("kvpool._core", path)
    spec = importlib.util.spec_from_file_location("kvpool._core", path, loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def flush_bytes() -> int:
    """Twice the largest CPU cache the kernel reports (cloud VMs report L3s of hundreds of MiB), at least 64 MiB
    and at most 2 GiB (the run's memory stays bounded on any machine)."""
    base, largest = "/sys/devices/system/cpu/cpu0/cache", 0
    for d in os.listdir(base) if os.path.isdir(base) else []:
        try:
            with open(os.path.join(base, d, "size")) as f:
                text = f.read().strip()
        except OSError:  # not a cache level (uevent)
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        if text.rstrip("KMG").isdigit():
            largest = max(largest, int(text.rstrip("KMG")) * scale)
    return min(max(64 << 20, 2 * largest), 2 << 30)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class PlainWrites:
    """The control: an admission's writes without a pool. Each call fills a fresh result array of
    8 bytes a token (numpy's zero-filled allocation, as the pool's result is) and each row's entries
    of the table, as ``admit(counts, table=)`` does; construction primes the C heap for the result
    as the pool's does (``heap_prime.rs``: one mapping allocated and freed, one heap block touched
    and freed). Run in the same flow, it tells how much of a first admission's cost over a warm one
    any first burst of writes of that size pays in this process and machine."""

    def __init__(self, n: int) -> None:
        self.n = n
        a = np.empty(n, dtype=np.int64)
        del a  # a fresh mapping, freed: glibc raises its mmap threshold to its size
        a = np.empty(n, dtype=np.int64)
        a[::512] = 0  # one write per 4 KiB: the heap block stays resident after the free
        del a

    def admit(self, counts: np.ndarray, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = np.zeros(self.n, dtype=np.int64)
        out += 1
        for row, c in enumerate(counts.tolist()):
            table[row, :c] = row
        return np.arange(len(counts)), out

    def close(self, handles: np.ndarray) -> None:
        pass

    def check(self) -> None:
        pass


def run(slots: int, page: int, kind: str, control: bool = False) -> dict:
    counts = prompts(kind)
    n = int(counts.sum())
    stride = ((CTX + 15) // 16 | 1) * 16  # KVPool's padded row stride
    table = np.full((ROWS + 1, stride), -1, dtype=np.int32)[:, :CTX]  # resident, as an engine's is
    core = None if control else _load_core()
    t0 = time.perf_counter_ns()
    alloc = PlainWrites(n) if core is None else core.SlotAllocator(slots // page, page, ROWS, CTX, kv_events=False)
    t1 = time.perf_counter_ns()
    # After construction: a GiB of fresh memory first would leave it fewer
    # free huge pages to map its records on than a server starting up has.
    flush = np.ones(flush_bytes() // 8, dtype=np.int64)
    flush += 1
    f0, t2 = _faults(), time.perf_counter_ns()
    handles, _ = alloc.admit(counts, table=table)
    t3, f1 = time.perf_counter_ns(), _faults()
    alloc.close(handles)
    del handles, _
    # Warm: the third admission. The second also warms what the Python call
    # allocates (its result array: the C heap grows once to hold it, then reuses it).
    handles, _ = alloc.admit(counts, table=table)
    alloc.close(handles)
    del handles, _
    flush += 1
    f2, t4 = _faults(), time.perf_counter_ns()
    alloc.admit(counts, table=table)
    t5, f3 = time.perf_counter_ns(), _faults()
    alloc.check()
    return {"slots": slots, "page_size": page, "prompts": kind, "tokens": n, "control": control,
            "construct_ms": (t1 - t0) / 1e6, "first_ns_per_token": (t3 - t2) / n,
            "warm_ns_per_token": (t5 - t4) / n, "first_faults": f1 - f0, "warm_faults": f3 - f2,
            "flush_mib": flush.nbytes >> 20}


if __name__ == "__main__":
    print(json.dumps(run(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], control=sys.argv[4:] == ["control"])))
