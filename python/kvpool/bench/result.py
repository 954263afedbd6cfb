"""The result row every workload reports: who ran, the timing, the memory, the slot count.

A workload's row (``churn/result.py``, ``prefix/result.py``) adds its own fields
and says which trace the row replayed (``case``) and whether the replay ended
consistent. Rows go to the JSON file as they are (``to_json``) and come back
from one for ``--reuse`` (``from_json``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from typing_extensions import Self

if TYPE_CHECKING:
    from kvpool.bench.runner import Measurement

R = TypeVar("R", bound="Result")


@dataclasses.dataclass(kw_only=True)
class Result:
    allocator: str
    label: str
    version: str
    page_size: int
    num_slots: int
    concurrency: int
    steps: int
    mean_batch: float
    mean_us: float
    cpu_mean_us: float  # thread CPU time per step (mean): the noise-resistant twin of mean_us
    p50_us: float
    p99_us: float
    max_us: float
    meta_bytes: int  # peak (sampled at step boundaries) of python_bytes + native_bytes
    python_bytes: int  # tracemalloc: Python objects and numpy arrays the allocator side holds
    native_bytes: int  # torch storages / Rust memory at that peak
    handed_slots: int  # every slot written over the whole replay
    expected_slots: int  # what the trace asked for
    repeat_means_us: list[float] = dataclasses.field(default_factory=list)  # when replayed several times

    # Properties the JSON rows carry besides the fields.
    json_properties: ClassVar[tuple[str, ...]] = ("consistent",)

    @classmethod
    def from_measurement(cls, m: Measurement) -> Self:
        """The row for one replay: these fields, and the workload's own (``workload_fields``)."""
        d, trace, s = m.driver, m.trace, m.summary
        cfg = trace.config
        return cls(
            allocator=d.name, label=d.label, version=d.version(), page_size=cfg.page_size,
            num_slots=cfg.num_slots, concurrency=cfg.concurrency, steps=len(trace.measured),
            mean_batch=trace.mean_batch(), mean_us=s["mean_us"], cpu_mean_us=s["cpu_mean_us"],
            p50_us=s["p50_us"], p99_us=s["p99_us"], max_us=s["max_us"], meta_bytes=sum(m.peak),
            python_bytes=m.peak[0], native_bytes=m.peak[1], handed_slots=m.handed,
            expected_slots=trace.total_slots, **cls.workload_fields(m),
        )

    @classmethod
    def workload_fields(cls, m: Measurement) -> dict[str, Any]:
        return {}

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Self:
        """A row from a stored JSON file (its computed properties are dropped, then recomputed)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in fields})

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update((name, getattr(self, name)) for name in self.json_properties)
        return d

    @property
    def case(self) -> tuple[Any, ...]:
        """The trace this row replayed, as a key that sorts in the CLI's order of cases."""
        return (self.page_size, self.num_slots, self.concurrency)

    @property
    def case_label(self) -> str:
        return f"page={self.page_size} pool={self.num_slots} conc={self.concurrency}"

    @property
    def consistent(self) -> bool:
        return self.handed_slots == self.expected_slots

    def inconsistency(self) -> str:
        """What went wrong, for the INCONSISTENT line of a row that is not ``consistent``."""
        return f"wrote {self.handed_slots} slots, expected {self.expected_slots}"

    def with_repeats(self, runs: list[Self]) -> Self:
        """This row, chosen among ``runs`` (replays of the same trace), carrying every run's mean."""
        self.repeat_means_us = [r.mean_us for r in runs]
        return self


def median_run(runs: list[R]) -> R:
    """The run with the median mean step time, carrying every run's mean."""
    chosen = sorted(runs, key=lambda r: r.mean_us)[(len(runs) - 1) // 2]
    return chosen.with_repeats(runs)


__all__ = ["Result", "median_run"]
