"""What a churn replay reports: the questions its drivers answer, and the row they make."""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool.bench.drivers.base import Driver
from kvpool.bench.result import Result

if TYPE_CHECKING:
    from kvpool.bench.runner import Measurement


class ChurnDriver(Driver):
    """A driver of the churn workload: after the drain every slot must be free again."""

    @abc.abstractmethod
    def free_slots(self) -> int:
        """Slots the allocator can still hand out (usable pages * page size when idle)."""

    @abc.abstractmethod
    def held_slots(self, lane: int, length: int) -> np.ndarray:
        """The slots the engine's table lists for the request in ``lane`` (for checks, untimed)."""


@dataclasses.dataclass(kw_only=True)
class ChurnResult(Result):
    ns_per_slot: float
    timed_slots: int
    end_free_slots: int  # after the drain step
    capacity_slots: int  # usable slots (page 0 excluded)
    consistent_all: bool = True  # every repeat (not only the one reported) ended consistent

    @classmethod
    def workload_fields(cls, m: Measurement) -> dict[str, Any]:
        cfg, driver = m.trace.config, m.driver
        return dict(ns_per_slot=m.summary["ns_per_item"], timed_slots=m.timed_items,
                    end_free_slots=driver.free_slots(), capacity_slots=cfg.usable_pages * cfg.page_size)

    @property
    def consistent(self) -> bool:
        ok = self.handed_slots == self.expected_slots and self.end_free_slots == self.capacity_slots
        return ok and self.consistent_all

    def inconsistency(self) -> str:
        return (f"handed {self.handed_slots} of {self.expected_slots} slots, {self.end_free_slots} of "
                f"{self.capacity_slots} free at the end")

    def with_repeats(self, runs: list[ChurnResult]) -> ChurnResult:  # type: ignore[override]
        self.consistent_all = all(r.consistent for r in runs)
        return super().with_repeats(runs)


__all__ = ["ChurnDriver", "ChurnResult"]
