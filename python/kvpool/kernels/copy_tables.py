"""The per-cache-set offsets tables of copy_slots, and how long they live.

copy_slots addresses every cache of a launch as the first cache's base pointer
plus an offset read from a small device table. A CUDA graph that captured such
a launch keeps the table's raw device address but holds no reference to the
tensor: if the table were freed (an LRU eviction), every replay would read
offsets out of freed memory and copy through whatever lands there.

So a table that was used while its stream was capturing is pinned: kept for
the life of the process (a few bytes per distinct set of caches a graph copies;
a pool's K/V buffers are one set). Tables used only eagerly live in a bounded
LRU. A table is a pure function of its key (the caches' addresses and dtype),
so reusing one after its caches were freed and others allocated at the same
addresses is still correct.

An evicted eager table may still be read by a copy queued on another stream than
the one it was allocated on: torch's caching allocator would hand its memory to
the next allocation on the allocating stream at once, and the queued copy would
read whatever that writes. So every stream that used a table is remembered, and
on eviction the table is marked in use by each (``Tensor.record_stream``): the
allocator then reuses the memory only after the work queued on those streams so
far has run.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch

from kvpool._forksafe import INNER
from kvpool._forksafe import track as track_for_fork
from kvpool.kernels._common import KernelArgumentError
from kvpool.modes import persistent

Key = tuple
Table = tuple[torch.Tensor, int]  # (device int64 offsets in units of `align` elements, align)


def is_capturing(t: torch.Tensor) -> bool:
    """Whether t's device's current stream is capturing a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def current_stream(t: torch.Tensor) -> Any | None:
    """The stream a launch on t's device goes to now (None on CPU: nothing is queued)."""
    return torch.cuda.current_stream(t.device) if t.is_cuda else None


def record_stream(table: torch.Tensor, stream: Any) -> None:
    """Keep table's memory from reuse until the work queued on ``stream`` so far has run."""
    table.record_stream(stream)


class _Entry:
    __slots__ = ("table", "streams")

    def __init__(self, table: Table) -> None:
        self.table = table
        self.streams: list[Any] = []  # every stream a launch that reads the table went to

    def used_on(self, stream: Any | None) -> None:
        if stream is not None and stream not in self.streams:
            self.streams.append(stream)


class OffsetTables:
    """Offsets tables keyed by (device, dtype, data_ptrs of the caches)."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._eager: OrderedDict[Key, _Entry] = OrderedDict()
        self._pinned: dict[Key, Table] = {}
        # Copies run from an engine's thread and from the tiers' transfer threads at once:
        # an LRU move, an eviction and a pin of one key must not interleave (a KeyError, or
        # a table evicted while a graph pins it).
        self._lock = threading.Lock()
        track_for_fork(self, "_lock", INNER)  # a forked child's first copy would wait on it

    def __len__(self) -> int:
        return len(self._eager) + len(self._pinned)

    @property
    def pinned(self) -> int:
        """How many tables are kept for captured graphs."""
        return len(self._pinned)

    def get(self, group: list[torch.Tensor]) -> Table:
        """The table for `group`, to be read by a launch on the current stream (built on
        the first eager call, pinned once used in capture).

        Raises KernelArgumentError inside capture when no table exists: building one
        there would copy from the host, which capture forbids."""
        key = (group[0].device, group[0].dtype) + tuple(t.data_ptr() for t in group)
        capturing = is_capturing(group[0])
        with self._lock:
            return self._get(key, group, capturing)

    def _get(self, key: Key, group: list[torch.Tensor], capturing: bool) -> Table:
        hit = self._pinned.get(key)
        if hit is not None:
            return hit
        entry = self._eager.get(key)
        if entry is not None:
            if capturing:
                del self._eager[key]
                self._pinned[key] = entry.table
            else:
                self._eager.move_to_end(key)
                entry.used_on(current_stream(group[0]))
            return entry.table
        if capturing:
            raise KernelArgumentError(
                "copy_slots: no offsets table for this set of caches inside CUDA graph capture. "
                "Call copy_slots once with the same caches before capturing (a warm-up), and "
                f"capture before more than {self.capacity} other cache sets are used eagerly"
            )
        entry = _Entry(_build(group))
        entry.used_on(current_stream(group[0]))
        self._eager[key] = entry
        if len(self._eager) > self.capacity:
            # Never a pinned table: graphs may still read those.
            _, old = self._eager.popitem(last=False)
            for stream in old.streams:
                record_stream(old.table[0], stream)
        return entry.table


def _build(group: list[torch.Tensor]) -> Table:
    esize = group[0].element_size()
    base = group[0].data_ptr()
    diffs = [t.data_ptr() - base for t in group]
    if any(dlt % esize for dlt in diffs):
        raise KernelArgumentError("copy_slots: cache addresses are not element-aligned")
    align = 16 // esize if all(dlt % 16 == 0 for dlt in diffs) and esize <= 16 else 1
    with persistent():  # a long-lived tensor, reused by later calls and captured graphs
        table = torch.tensor([dlt // esize // align for dlt in diffs], dtype=torch.int64,
                             device=group[0].device)
    return table, align


TABLES = OffsetTables()
