"""Hybrid prefix traces: the prefix scenarios on a pool of two layer groups, full attention and a
sliding window, and how that pool's memory is split between them.

The steps are the prefix workload's (``prefix/trace.py``: shared system prompts, multi-turn chat,
parallel sampling; token ids part of the trace), with a per-step prefill budget
(``step_prompt_tokens``), because a sliding-window group holds a prompt whole during the step that
prefills it. ``num_slots`` is the whole pool, both groups together, in page-sized slots of one
group's layers (vLLM's shared block pool has exactly that many blocks). Admission budgets the full
group as the prefix workload budgets its one pool (every running sequence's whole lifetime fits
without sharing); ``split`` gives the sliding group enough that it never runs short either, so no
allocator ever has to preempt, and the rest as cache room.
"""

from __future__ import annotations

import dataclasses

from kvpool.bench.prefix.trace import PrefixTrace, PrefixTraceConfig, generate


def sliding_floor(concurrency: int, page_size: int, window: int, step_tokens: int) -> int:
    """Pages (page 0 included) a sliding group needs so that it never runs short: each running
    sequence's window (``window`` tokens, the one being written included, over at most
    ceil(window / page) + 1 pages), a page of headroom per sequence, and one step's prefill held whole."""
    per_lane = -(-window // page_size) + 2
    return 1 + concurrency * per_lane + -(-step_tokens // page_size)


def split(num_slots: int, concurrency: int, page_size: int, window: int, step_tokens: int,
          sliding_cache_share: float) -> int:
    """The sliding group's pages in a pool of ``num_slots`` slots: its floor, and
    ``sliding_cache_share`` of what is left over (the cache room; the rest goes to the full group)."""
    total = num_slots // page_size
    floor = sliding_floor(concurrency, page_size, window, step_tokens)
    if floor + 2 > total:
        raise ValueError(f"a pool of {total} pages cannot hold {concurrency} sequences' windows of {window} "
                         f"tokens and a {step_tokens}-token prefill ({floor} sliding pages) and a full group")
    return floor + int(sliding_cache_share * (total - floor))


@dataclasses.dataclass(frozen=True)
class HybridTraceConfig(PrefixTraceConfig):
    window: int = 1024  # sliding window, the token itself included (Hugging Face sliding_window)
    sliding_pages: int = 0  # the sliding group's share of num_slots, in pages (page 0 included)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.step_prompt_tokens < 1:
            raise ValueError("a hybrid trace needs step_prompt_tokens >= 1 (the sliding group is sized by it)")
        floor = sliding_floor(self.concurrency, self.page_size, self.window,
                              max(self.step_prompt_tokens, self.max_prompt_len))
        if not floor <= self.sliding_pages <= self.num_pages - 2:
            raise ValueError(f"sliding_pages must be in [{floor}, {self.num_pages - 2}], got {self.sliding_pages}")

    @property
    def full_pages(self) -> int:
        """The full group's pages (page 0 included)."""
        return self.num_pages - self.sliding_pages

    @property
    def usable_pages(self) -> int:
        # Admission budgets the full group: the sliding one is sized never to run short.
        return self.full_pages - 1


def generate_hybrid(cfg: HybridTraceConfig) -> PrefixTrace:
    return generate(cfg)


__all__ = ["HybridTraceConfig", "generate_hybrid", "sliding_floor", "split"]
