"""What every driver provides to the runner, whatever the workload.

A driver owns one allocator and the host-side tables its engine keeps next to
it (SGLang: ``req_to_token``; vLLM: block lists, block table and slot mapping;
kvpool: the CPU ``req_to_token`` it fills in place). For each trace step the
runner calls ``prepare`` (untimed: turns the scheduler's decisions into the
inputs the engine already holds, e.g. ``seq_lens`` tensors or request ids) and
then ``run`` (timed: the allocator calls and table updates the engine makes).
A workload's driver interface (``churn/result.py``, ``prefix/result.py``) adds
the questions its result row asks once the replay is over.
"""

from __future__ import annotations

import abc
import contextlib
import sys
from collections.abc import Iterator
from importlib import metadata
from typing import Any, ClassVar

import torch


class Requirement:
    """Modules a baseline driver imports from its engine's package, and why they did not import."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.error: str | None = None

    @contextlib.contextmanager
    def imports(self) -> Iterator[None]:
        """Runs a driver module's baseline imports; a failure is kept as the skip reason, since any
        import failure (a missing package, a dependency, a torch mismatch) means "not installed here"."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001
            self.error = f"{type(exc).__name__}: {exc}"

    def skip_reason(self) -> str | None:
        if self.error is None:
            return None
        return f"{self.what} not importable ({self.error}); install: see docs/benchmarks.md 'Installing the baselines'"


class Driver(abc.ABC):
    """One allocator replaying a trace. Subclasses set ``name`` and ``label``."""

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    package: ClassVar[str] = "kvpool"  # the distribution whose version the result rows carry
    # What this class imports from its baseline; a subclass lists only what it adds.
    requires: ClassVar[tuple[Requirement, ...]] = ()

    def __init__(self, cfg: Any, max_step_tokens: int = 8192) -> None:
        # max_step_tokens: most slots any step of the trace hands out (sizes per-step buffers).
        why = self.skip_reason()
        if why is not None:
            raise RuntimeError(why)
        self.cfg = cfg
        self.max_step_tokens = max_step_tokens

    @classmethod
    def supports(cls, page_size: int) -> bool:
        """Whether the allocator runs at this page size (runs at other sizes are left out silently)."""
        return True

    @classmethod
    def skip_reason(cls) -> str | None:
        """Why this driver cannot run here, in one line (None: it can)."""
        for klass in reversed(cls.__mro__):  # the shared base's imports first
            for requirement in vars(klass).get("requires", ()):
                why = requirement.skip_reason()
                if why is not None:
                    return why
        return None

    @abc.abstractmethod
    def prepare(self, step: Any) -> Any:
        """Untimed: the step's inputs in the form the engine keeps them."""

    @abc.abstractmethod
    def run(self, prep: Any) -> int:
        """Timed: the step's allocator calls and table updates; returns the slots written."""

    def counters(self) -> dict[str, int]:
        """Running totals the runner reads just before and just after the timed steps: their
        differences are what the measured steps did (cold-start work excluded)."""
        return {}

    def native_bytes(self) -> int:
        """Metadata bytes tracemalloc cannot see (torch storages, Rust memory)."""
        return 0

    def version(self) -> str:
        return package_version(self.package)


def package_version(name: str) -> str:
    """The version of the ``name`` this process imported (a checkout on PYTHONPATH may differ
    from the installed distribution), else the installed one's, else ''."""
    version = getattr(sys.modules.get(name), "__version__", "")
    if version:
        return str(version)
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def storage_bytes(*tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors``.

    A sliced free list (``free_pages[n:]``) keeps its whole storage alive, so
    counting ``numel`` would under-report what the allocator holds.
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


__all__ = ["Driver", "Requirement", "package_version", "storage_bytes"]
