"""The table's columns that every workload shares, and how a pool size prints.

Kept apart from ``report.py`` so a workload, the report and the plot all read
them without importing one another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Column = tuple[str, Callable[[Any], str]]  # header, and the cell of a row

# Columns most workloads show, in the form a workload lists them.
PAGE: Column = ("page", lambda r: str(r.page_size))
POOL: Column = ("pool", lambda r: size(r.num_slots))
ALLOCATOR: Column = ("allocator", lambda r: r.allocator)
STEP_TIMES: list[Column] = [
    ("µs/step mean", lambda r: f"{r.mean_us:.1f}"), ("p50", lambda r: f"{r.p50_us:.1f}"),
    ("p99", lambda r: f"{r.p99_us:.1f}"), ("cpu µs mean", lambda r: f"{r.cpu_mean_us:.1f}"),
]
META_MIB: Column = ("meta MiB", lambda r: f"{r.meta_bytes / 2**20:.1f}")


def size(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)
