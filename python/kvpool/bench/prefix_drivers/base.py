"""What every prefix-cache driver provides to the prefix runner.

A driver owns one allocator with its prefix cache and the host tables its engine
keeps next to them. Per trace step the runner calls ``prepare`` (untimed: the
scheduler's decisions in the form the engine holds them: token lists, request
records, tensors) and then ``run`` (timed: the cache and allocator calls and the
table updates the engine makes for that step, in the order its scheduler makes
them). The counters are plain integer additions made inside ``run``.
"""

from __future__ import annotations

import abc
from typing import Any

from kvpool.bench.prefix_trace import PrefixStep, PrefixTraceConfig


class PrefixDriver(abc.ABC):
    """One allocator + prefix cache replaying a prefix trace. Subclasses set ``name`` and ``label``."""

    name: str = ""
    label: str = ""

    def __init__(self, cfg: PrefixTraceConfig, max_step_tokens: int = 8192) -> None:
        self.cfg = cfg
        self.max_step_tokens = max_step_tokens
        self.prompt_tokens = 0  # prompt tokens of every admitted sequence (n per parallel group)
        self.computed_tokens = 0  # prompt tokens the engine had to prefill (not served by the cache)

    @classmethod
    def supports(cls, page_size: int) -> bool:
        return True

    @abc.abstractmethod
    def prepare(self, step: PrefixStep) -> Any:
        """Untimed: the step's inputs in the form the engine keeps them."""

    @abc.abstractmethod
    def run(self, prep: Any) -> int:
        """Timed: release, admit (match, lock, allocate, fork), decode; returns slots written."""

    @abc.abstractmethod
    def held_pages(self) -> int:
        """Pages that open requests hold (0 once everything is released)."""

    @abc.abstractmethod
    def cached_pages(self) -> int:
        """Pages the prefix cache keeps for later hits (not held by any request)."""

    @abc.abstractmethod
    def evicted_pages(self) -> int:
        """Cached pages evicted so far to make room."""

    def hit_tokens(self) -> int:
        return self.prompt_tokens - self.computed_tokens

    def backend(self) -> str:
        """Which implementation served the prefix cache (SGLang: its tree core)."""
        return ""

    def native_bytes(self) -> int:
        """Metadata bytes tracemalloc cannot see (torch storages, Rust memory)."""
        return 0

    def version(self) -> str:
        return ""


def dist_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""
