"""What a prefix replay reports: the questions its drivers answer, and the row they make."""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from kvpool.bench.drivers.base import Driver
from kvpool.bench.prefix.trace import SCENARIOS
from kvpool.bench.result import Result

if TYPE_CHECKING:
    from kvpool.bench.runner import Measurement


class PrefixDriver(Driver):
    """A driver of the prefix workload: an allocator with its prefix cache.

    ``run`` adds to two plain integer counters as it admits sequences; the
    runner reads them around the timed steps, so hits are reported over the
    measured steps (the cache's steady state, not its cold start).
    """

    def __init__(self, cfg: Any, max_step_tokens: int = 8192) -> None:
        super().__init__(cfg, max_step_tokens)
        self.prompt_tokens = 0  # prompt tokens of every admitted sequence (n per parallel group)
        self.computed_tokens = 0  # prompt tokens the engine had to prefill (not served by the cache)
        self.offloaded_pages = 0  # host tier: pages copied device -> host
        self.loaded_pages = 0  # host tier: pages copied host -> device

    def counters(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens(),
                "offloaded_pages": self.offloaded_pages, "loaded_pages": self.loaded_pages}

    def hit_tokens(self) -> int:
        return self.prompt_tokens - self.computed_tokens

    @abc.abstractmethod
    def held_pages(self) -> int:
        """Pages that open requests hold (0 once everything is released)."""

    @abc.abstractmethod
    def cached_pages(self) -> int:
        """Pages the prefix cache keeps for later hits (not held by any request)."""

    @abc.abstractmethod
    def evicted_pages(self) -> int:
        """Cached pages evicted so far to make room."""

    def backend(self) -> str:
        """Which implementation served the prefix cache (SGLang: its tree core)."""
        return ""

    def host_pages(self) -> int:
        """Host tier capacity in pages (0: the driver has none)."""
        return 0


class HostTierDriver(PrefixDriver):
    """A prefix driver with a host tier under ``policy``: ``cfg.host_pages - 1`` host pages, the
    ones kvpool's host tier can use (its page 0 is reserved), for every such driver alike."""

    policy: ClassVar[str] = ""
    tier: ClassVar[str] = ""  # what serves the cache and its tier

    def host_pages(self) -> int:
        return int(self.cfg.host_pages) - 1

    def backend(self) -> str:
        return f"{self.tier} ({self.policy})"


@dataclasses.dataclass(kw_only=True)
class PrefixResult(Result):
    backend: str  # which implementation served the cache (SGLang: its tree)
    scenario: str
    prompt_tokens: int  # prompts of the sequences admitted in the measured steps (n per parallel group)
    hit_tokens: int  # of those, served by the prefix cache (not prefilled)
    total_prompt_tokens: int  # the same over the whole trace, cold start included
    total_hit_tokens: int
    evicted_pages: int
    cached_pages_end: int  # kept by the cache after the drain
    held_pages_end: int  # held by requests after the drain: must be 0
    host_pages: int = 0  # host tier capacity in pages (0: none)
    offloaded_pages: int = 0  # over the measured steps: device -> host page copies
    loaded_pages: int = 0  # over the measured steps: host -> device page copies

    json_properties: ClassVar[tuple[str, ...]] = ("hit_share", "consistent", "moved_pages_per_step")
    # Written only for rows with a host tier, so rows stored before the tier read back unchanged.
    tier_fields: ClassVar[tuple[str, ...]] = ("host_pages", "offloaded_pages", "loaded_pages", "moved_pages_per_step")

    def to_json(self) -> dict[str, Any]:
        d = super().to_json()
        if not self.host_pages:
            for k in self.tier_fields:
                d.pop(k, None)
        return d

    @classmethod
    def workload_fields(cls, m: Measurement) -> dict[str, Any]:
        d = m.driver
        return dict(backend=d.backend(), scenario=m.trace.config.scenario,
                    prompt_tokens=m.counted["prompt_tokens"], hit_tokens=m.counted["hit_tokens"],
                    total_prompt_tokens=d.prompt_tokens, total_hit_tokens=d.hit_tokens(),
                    evicted_pages=d.evicted_pages(), cached_pages_end=d.cached_pages(),
                    held_pages_end=d.held_pages(), host_pages=d.host_pages(),
                    offloaded_pages=m.counted.get("offloaded_pages", 0), loaded_pages=m.counted.get("loaded_pages", 0))

    @property
    def hit_share(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def moved_pages_per_step(self) -> float:
        """Pages copied between device and host per measured step (offloads + loads)."""
        return (self.offloaded_pages + self.loaded_pages) / self.steps if self.steps else 0.0

    @property
    def case(self) -> tuple[Any, ...]:
        return (SCENARIOS.index(self.scenario), self.page_size, self.num_slots)

    @property
    def case_label(self) -> str:
        return f"{self.scenario} page={self.page_size} pool={self.num_slots}"

    @property
    def consistent(self) -> bool:
        # expected_slots counts every prompt token; a hit is a slot the cache supplies, not one written.
        return self.held_pages_end == 0 and self.handed_slots == self.expected_slots - self.total_hit_tokens

    def inconsistency(self) -> str:
        return (f"{self.held_pages_end} pages still held after the drain, wrote {self.handed_slots} slots, "
                f"expected {self.expected_slots - self.total_hit_tokens}")


__all__ = ["HostTierDriver", "PrefixDriver", "PrefixResult"]
