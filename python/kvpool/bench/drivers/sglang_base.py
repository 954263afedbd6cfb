"""What SGLang's drivers share: its real token / paged allocator, built as its scheduler builds it.

Imported from the installed ``sglang`` package (``sglang.srt.mem_cache.allocator``);
nothing here re-implements it.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpool.bench.drivers.base import Driver, Requirement, storage_bytes

SGLANG_ALLOCATORS = Requirement("sglang allocators")
with SGLANG_ALLOCATORS.imports():
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # type: ignore[import-untyped,unused-ignore]


class SGLangBase(Driver):
    """``self.alloc`` (token allocator at page 1, paged above); a subclass sets ``self.req_to_token``."""

    package = "sglang"
    requires = (SGLANG_ALLOCATORS,)
    req_to_token: torch.Tensor

    def __init__(self, cfg: Any, max_step_tokens: int = 8192) -> None:
        super().__init__(cfg, max_step_tokens)
        P = cfg.page_size
        # Sized to the usable slots: SGLang keeps slot 0 (page 0) out of its free list, like kvpool's page 0.
        if P == 1:
            self.alloc: Any = TokenToKVPoolAllocator(cfg.num_slots - 1, torch.float16, "cpu", None, need_sort=False)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(cfg.num_slots - P, P, torch.float16, "cpu", None,
                                                     need_sort=False)

    def native_bytes(self) -> int:
        a = self.alloc
        extra = list(getattr(a, "staged_pages", []) or [])
        return storage_bytes(a.free_pages, a.release_pages, *extra) + storage_bytes(self.req_to_token)


__all__ = ["SGLANG_ALLOCATORS", "SGLangBase"]
