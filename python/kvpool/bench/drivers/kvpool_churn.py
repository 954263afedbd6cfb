"""kvpool's SlotAllocator, driven the way kvpool.KVPool drives it on the host.

Per step: ``close`` the finished requests, one ``admit`` (open + extend by the
prompt lengths, in one call) for the admitted ones, one batched
``extend(handles, 1)`` for the decode batch. Every ``extend`` also fills the CPU ``req_to_token`` table in
place (``table=``), the same update SGLang's engine makes, so the work matches,
and writes its slots into one step buffer kept from step to step (``out=``), as
vLLM's model runner keeps its ``slot_mapping`` buffer (the vLLM driver gets the
same persistent buffers from vLLM's ``BlockTable``).
Opening and closing request rows is timed here although the baselines get
their rows from the trace for free: that only counts against kvpool.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.bench.churn.result import ChurnDriver
from kvpool.bench.churn.trace import ChurnStep, ChurnTraceConfig
from kvpool.bench.drivers.kvpool_base import KVPoolBase


class KVPoolChurnDriver(KVPoolBase, ChurnDriver):
    label = "kvpool SlotAllocator"

    def __init__(self, cfg: ChurnTraceConfig, max_step_tokens: int = 8192) -> None:
        super().__init__(cfg, max_step_tokens)
        # The step's slots (out_cache_loc / slot_mapping), in buffers reused
        # every step: the prefill's and the decode batch's.
        self.prefill_slots = np.zeros(max_step_tokens, dtype=np.int64)
        self.decode_slots = np.zeros(cfg.concurrency, dtype=np.int64)
        self._prepared = 0  # prepare() calls so far: steps in trace order
        self._decoding: np.ndarray | None = None

    def prepare(self, step: ChurnStep) -> Any:
        # Checked only where no timed step follows (the warmup steps, and the
        # drain after the measured ones): the check's own memory traffic just
        # before a timed step would push what that step reads out of the CPU caches.
        untimed = self._prepared < self.cfg.warmup or self._prepared >= self.cfg.warmup + self.cfg.steps
        self._prepared += 1
        if untimed:
            self._check_last_decode()
        decoding = self.handles[step.decode_lanes]
        self._decoding = decoding
        return (
            self.handles[step.release_lanes],
            step.admit_lanes,
            step.admit_counts,
            decoding,
            step.slots,
        )

    def _check_last_decode(self) -> None:
        """Untimed: the last decode step's ``out=`` slots are the slots its requests
        now end with, in the allocator and in the table. ``run`` returns the
        trace's slot count (``extend(out=)`` returns the buffer, not the slots),
        so this is what checks that each decode step really handed them out."""
        hs = self._decoding
        if hs is None or len(hs) == 0:
            return
        a = self.alloc
        rows, ends = a.rows(hs), a.lengths(hs) - 1
        got = self.decode_slots[: len(hs)]
        last = np.array([a.slots(int(h))[-1] for h in hs[:4]], dtype=np.int64)
        if not (np.array_equal(self.table[rows, ends], got) and np.array_equal(last, got[:4])):
            raise AssertionError("kvpool driver: a decode step's out= slots disagree with the table")

    def run(self, prep: Any) -> int:
        finished, admit_lanes, admit_counts, decoding, slots = prep
        a = self.alloc
        if len(finished):
            a.close(finished)
        if len(admit_lanes):
            if slots > len(self.prefill_slots):  # a step past max_step_tokens: grow once
                self.prefill_slots = np.zeros(slots, dtype=np.int64)
            h, _ = a.admit(admit_counts, table=self.table, out=self.prefill_slots)
            self.handles[admit_lanes] = h
        if len(decoding):
            a.extend(decoding, 1, table=self.table, out=self.decode_slots)
        return slots

    def held_slots(self, lane: int, length: int) -> np.ndarray:
        row = int(self.alloc.rows(self.handles[lane : lane + 1])[0])
        return self.table[row, :length].astype(np.int64)

    def free_slots(self) -> int:
        return int(self.alloc.free_slots)


__all__ = ["KVPoolChurnDriver"]
