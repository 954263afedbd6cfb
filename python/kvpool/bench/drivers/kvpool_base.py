"""What kvpool's drivers share: the allocator and the engine's CPU ``req_to_token``, as KVPool lays them out."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

import kvpool
from kvpool.bench.drivers.base import Driver
from kvpool.layout import padded_table


class KVPoolBase(Driver):
    name = "kvpool"
    groups: ClassVar[int] = 1  # KV cache groups: one req_to_token each

    def __init__(self, cfg: Any, max_step_tokens: int = 8192) -> None:
        super().__init__(cfg, max_step_tokens)
        self.alloc = self.new_allocator()
        # The engine's CPU req_to_token of each group (KVPool mirrors them to the device), with
        # KVPool's padded row stride.
        self.tables = [padded_table(cfg.concurrency, cfg.max_context_len) for _ in range(self.groups)]
        # np.zeros maps pages lazily; torch.zeros (the baselines' tables) writes them. Touch them
        # here so first-write page faults are not timed for kvpool only.
        for t in self.tables:
            t.fill(0)
        self.table = self.tables[0]
        # Engine batch state: the handle of the request in each lane.
        self.handles = np.zeros(cfg.concurrency, dtype=np.int64)

    def new_allocator(self) -> Any:
        cfg = self.cfg
        return kvpool.SlotAllocator(cfg.num_pages, cfg.page_size, cfg.concurrency, cfg.max_context_len)

    def native_bytes(self) -> int:
        return int(self.alloc.metadata_bytes)


__all__ = ["KVPoolBase"]
