"""What a workload declares, so that one runner, one report and one plot serve every workload.

A workload is a package (``churn/``, ``prefix/``) holding its seeded trace
generator, its result row and driver interface (``result.py``) and its figures.
It declares the flags of its command, the cases a run replays, the table
columns, the ratios it holds against its targets and the plot panels. Its
drivers are registered under its name in ``drivers/``. A new workload (a host
tier, layer groups, a router) is a new package and its drivers; the runner,
``command.py``, the report and the plot do not change.
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
from typing import Any, ClassVar

from kvpool.bench.cli import UsageError
from kvpool.bench.columns import Column
from kvpool.bench.drivers.base import Driver
from kvpool.bench.plot import Panel
from kvpool.bench.result import Result
from kvpool.bench.runner import measure
from kvpool.bench.trace import Trace


@dataclasses.dataclass(frozen=True)
class Case:
    """One trace of a run, and how many times each driver replays it."""

    config: Any  # the workload's trace config (page_size decides which drivers run it)
    label: str  # progress-bar text
    repeats: int = 1
    repeated: frozenset[str] | None = None  # the allocators the repeats apply to (None: all)

    def repeats_of(self, allocator: str) -> int:
        return self.repeats if self.repeated is None or allocator in self.repeated else 1


class Workload(abc.ABC):
    name: ClassVar[str]  # the CLI command and the key of its drivers in the registry
    result_type: ClassVar[type[Result]]
    columns: ClassVar[list[Column]]  # the table, left to right
    # (header, result field): the row's field over kvpool's on the same trace, after the columns.
    versus_kvpool: ClassVar[list[tuple[str, str]]] = [("÷ kvpool", "mean_us")]
    plot_title: ClassVar[str]
    plot_inches: ClassVar[tuple[float, float]]  # width, height per page-size row
    # Settings that must agree with a stored JSON file's for --reuse to take its rows
    # (the ones the traces depend on); empty: the workload has no --reuse.
    reuse_settings: ClassVar[tuple[str, ...]] = ()
    # --quick: the defaults it puts in place of the full run's (a flag given explicitly keeps its value).
    quick_defaults: ClassVar[dict[str, Any]] = {}

    @abc.abstractmethod
    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        """The command's flags (``cli.add_replay_arguments`` and the workload's own)."""

    def check(self, args: argparse.Namespace) -> None:
        """Raise ``UsageError`` for flags that cannot run together, before anything runs (a bad trace
        config is one); a workload may first fill in defaults that depend on other flags."""
        try:
            self.cases(args)
        except UsageError:
            raise
        except ValueError as e:
            raise UsageError(str(e)) from None

    @abc.abstractmethod
    def cases(self, args: argparse.Namespace) -> list[Case]:
        """The traces to replay, in report order."""

    @abc.abstractmethod
    def generate(self, config: Any) -> Trace:
        """The seeded trace of a case (the same config gives the same trace)."""

    @abc.abstractmethod
    def ratios(self, results: list[Any], args: argparse.Namespace) -> dict[str, Any]:
        """The JSON ``ratios``: the figures the workload holds against its targets."""

    @abc.abstractmethod
    def ratio_lines(self, ratios: dict[str, Any]) -> str:
        """``ratios`` for the terminal."""

    @abc.abstractmethod
    def panels(self, args: argparse.Namespace) -> list[Panel]:
        """The plot's panels, left to right (a row of them per page size)."""

    def machine(self, machine: dict[str, Any]) -> dict[str, Any]:
        """The JSON ``machine`` record, with whatever this workload adds about the environment."""
        return machine

    def notes(self, machine: dict[str, Any]) -> list[str]:
        """Lines printed after the ratios."""
        return []

    def replay(self, driver_cls: type[Driver], trace: Trace) -> Any:
        """One replay of ``trace`` on a fresh ``driver_cls``, as this workload's result row."""
        return self.result_type.from_measurement(measure(driver_cls, trace))


__all__ = ["Case", "Workload"]
