"""What every allocator driver provides to the runner.

A driver owns one allocator and the host-side table its engine keeps next to it
(SGLang: ``req_to_token``; vLLM: block lists, block table and slot mapping;
kvpool: the CPU ``req_to_token`` it fills in place). For each trace step the
runner calls ``prepare`` (untimed: turns the scheduler's decisions into the
inputs the engine already holds, e.g. ``seq_lens`` tensors or request ids) and
then ``run`` (timed: the allocator calls and table updates the engine makes).
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np
import torch

from kvpool.bench.trace import Step, TraceConfig


class Driver(abc.ABC):
    """One allocator replaying a trace. Subclasses set ``name`` and ``label``."""

    name: str = ""
    label: str = ""

    def __init__(self, cfg: TraceConfig, max_step_tokens: int = 8192) -> None:
        # max_step_tokens: most slots any step of the trace hands out (sizes per-step buffers).
        self.cfg = cfg
        self.max_step_tokens = max_step_tokens

    @classmethod
    def supports(cls, page_size: int) -> bool:
        return True

    @abc.abstractmethod
    def prepare(self, step: Step) -> Any:
        """Untimed: the step's inputs in the form the engine keeps them."""

    @abc.abstractmethod
    def run(self, prep: Any) -> int:
        """Timed: release, prefill and decode for one step; returns slots handed out."""

    @abc.abstractmethod
    def free_slots(self) -> int:
        """Slots the allocator can still hand out (usable pages * page size when idle)."""

    @abc.abstractmethod
    def held_slots(self, lane: int, length: int) -> np.ndarray:
        """The slots the engine's table lists for the request in ``lane`` (for checks, untimed)."""

    def native_bytes(self) -> int:
        """Metadata bytes tracemalloc cannot see (torch storages, Rust memory)."""
        return 0

    def version(self) -> str:
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
