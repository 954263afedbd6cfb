"""How many pages a pool gets: from pages, slots, bytes or a fraction of free memory.

Pure arithmetic (no tensors are created here), so budgets can be planned and
tested without the memory. Page 0 is reserved by the allocator and counted in
``num_pages``, exactly as in ``SlotAllocator``.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

import torch

from kvpool._core import InvalidArgumentError
from kvpool.layout import padded_row_stride

__all__ = ["MAX_PAGES", "MAX_SLOTS", "budget_bytes", "bytes_per_slot", "fraction_of_memory", "free_device_memory",
           "pages_of_slots", "resolve_num_pages", "slot_limit_hint", "table_bytes"]

#: Most slots a pool may have: ``req_to_token`` and the page tables are int32,
#: so every slot id must be below 2**31 (a bigger pool would wrap to negative
#: ids, which kernels treat as padding).
MAX_SLOTS = 2**31

#: Most pages an allocator takes, reserved page 0 included (its page ids are int32).
MAX_PAGES = 2**31 - 1


def _count(name: str, value: Any, least: str = "0") -> int:
    """A non-negative int capacity argument (numpy ints too; no bools, floats or strings).
    A negative one is told ``least``, the argument's least valid value (with its reason)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        hint = ""
        if isinstance(value, float) and math.isfinite(value):
            hint = f"; use {int(value)}" if value.is_integer() else f"; use {math.floor(value)} or {math.ceil(value)}"
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__} {value!r}{hint}")
    if value < 0:
        raise InvalidArgumentError(f"{name} must be >= {least}, got {value}")
    return int(value)


def _real(name: str, value: Any) -> float:
    """A finite real number (int or float; no bools or strings)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise InvalidArgumentError(f"{name} must be finite, got {value!r}")
    return v


def budget_bytes(name: str, value: Any) -> int:
    """A byte budget (``memory_bytes``, ``host_memory_bytes``) as an exact int: ints as given
    (through ``float`` a budget past 2**53 could round up and size a pool past it), finite
    floats rounded down (engines compute budgets as ``0.9 * total``). No bools or strings."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} must be a number of bytes, got {type(value).__name__} {value!r}")
    if isinstance(value, numbers.Integral):
        budget = int(value)
    else:
        v = float(value)
        if not math.isfinite(v):
            raise InvalidArgumentError(f"{name} must be finite, got {value!r}")
        budget = math.floor(v)
    if budget < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {value!r}")
    return budget


def fraction_of_memory(value: Any) -> float:
    """``memory_fraction``: a real number in (0, 1] (numpy floats too; no bools or strings)."""
    fraction = _real("memory_fraction", value)
    if not 0.0 < fraction <= 1.0:
        raise InvalidArgumentError(f"memory_fraction must be in (0, 1], got {value!r}")
    return fraction


def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, *, mla: bool) -> int:
    """K/V bytes one token slot takes across all layers (MLA: one latent row)."""
    per_row = num_kv_heads * head_dim * dtype.itemsize
    return num_layers * per_row * (1 if mla else 2)


def table_bytes(max_requests: int, max_context_len: int) -> int:
    """Bytes of ``req_to_token`` as allocated (int32, one extra null row, each row
    padded to ``padded_row_stride``): the padding is device memory too."""
    return (max_requests + 1) * padded_row_stride(max_context_len) * 4


def free_device_memory(device: torch.device) -> int:
    """Free bytes on ``device``: on CUDA the driver's free memory plus what torch's caching
    allocator holds unused, or the host's available RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        # The driver counts memory torch reserved as used even where no tensor lives in it
        # (a model's load, a warm-up's activations): the pool's tensors are allocated through
        # that same allocator, which reuses those blocks, or releases them and retries the
        # driver when one is too small. Left out, a pool made after a warm-up came out smaller
        # by whatever the warm-up left cached. Not counted: free pieces of segments that also
        # hold live tensors ("inactive split"), which cannot be released and may be too small.
        stats = torch.cuda.memory_stats(device)
        cached = (stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
                  - stats.get("inactive_split_bytes.all.current", 0))
        return int(free) + max(int(cached), 0)
    if device.type == "cpu":
        return _available_host_memory()
    raise InvalidArgumentError(
        f"memory_fraction needs a cuda or cpu device to measure free memory, got {device}; pass memory_bytes"
    )


def _available_host_memory() -> int:
    """The kernel's MemAvailable (free RAM plus the page cache it can reclaim) where
    /proc/meminfo has it: free RAM alone (``SC_AVPHYS_PAGES``) leaves out the page
    cache, often half the machine, and moves with whatever was read last."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def pages_of_slots(num_slots: Any, page_size: int) -> int:
    """``num_slots`` as pages of ``page_size`` (an int, numpy ints too), or an
    ``InvalidArgumentError`` that suggests the nearest sizes a pool takes: two pages at
    least (page 0 is reserved), within the limits. The plain and the hybrid pool's check."""
    num_slots = _count("num_slots", num_slots, f"{2 * page_size} (two pages of page_size={page_size}: page 0 is "
                       "reserved)")
    if num_slots % page_size:
        near = (num_slots // page_size, -(-num_slots // page_size))
        ok = [n * page_size for n in near if 2 <= n <= MAX_PAGES and n * page_size <= MAX_SLOTS]
        fix = (f"use {' or '.join(map(str, ok))}" if ok else
               f"use {2 * page_size} (two pages: page 0 is reserved)" if 2 * page_size <= MAX_SLOTS else
               slot_limit_hint(page_size, "num_slots"))
        raise InvalidArgumentError(f"num_slots={num_slots} is not a multiple of page_size={page_size}; {fix}")
    return num_slots // page_size


def resolve_num_pages(
    *,
    page_size: int,
    slot_bytes: int,
    fixed_bytes: int,
    num_pages: int | None,
    num_slots: int | None,
    memory_bytes: int | None,
    memory_fraction: float | None,
    device: torch.device,
) -> int:
    """Total pages (reserved page 0 included) from exactly one capacity argument.

    ``memory_bytes`` / ``memory_fraction`` budget everything the pool puts on
    the device: K/V pages plus ``fixed_bytes`` (tables and scales).
    """
    given = {
        k: v
        for k, v in (
            ("num_pages", num_pages),
            ("num_slots", num_slots),
            ("memory_bytes", memory_bytes),
            ("memory_fraction", memory_fraction),
        )
        if v is not None
    }
    if len(given) != 1:
        raise InvalidArgumentError(
            "give exactly one of num_pages, num_slots, memory_bytes, memory_fraction; "
            f"got {sorted(given) or 'none'}"
        )
    if num_pages is not None:
        pages = _count("num_pages", num_pages, "2 (page 0 is reserved)")
    elif num_slots is not None:
        pages = pages_of_slots(num_slots, page_size)
    else:
        if memory_fraction is not None:
            budget = int(free_device_memory(device) * fraction_of_memory(memory_fraction))
        else:
            budget = budget_bytes("memory_bytes", memory_bytes)
        page_bytes = slot_bytes * page_size
        pages = (budget - fixed_bytes) // page_bytes if budget > fixed_bytes else 0
        if pages < 2:
            raise InvalidArgumentError(
                f"a budget of {budget} bytes holds {max(pages, 0)} pages of {page_bytes} bytes after "
                f"{fixed_bytes} bytes of tables; need >= {fixed_bytes + 2 * page_bytes} bytes "
                "(page 0 is reserved, so at least two pages)"
            )
    if pages < 2:
        raise InvalidArgumentError(f"a pool needs >= 2 pages (page 0 is reserved), got {pages}")
    if pages > MAX_PAGES and pages * page_size <= MAX_SLOTS:  # (page size 1: 2**31 pages fit the slots)
        raise InvalidArgumentError(
            f"{pages} pages, more than the {MAX_PAGES} an allocator addresses (page ids are int32); "
            + slot_limit_hint(page_size, next(iter(given)), slot_bytes * page_size, fixed_bytes)
        )
    if pages * page_size > MAX_SLOTS:
        raise InvalidArgumentError(
            f"{pages} pages of {page_size} slots = {pages * page_size} slots, more than the "
            f"{MAX_SLOTS} (2**31) that int32 req_to_token and page tables can address; "
            + slot_limit_hint(page_size, next(iter(given)), slot_bytes * page_size, fixed_bytes)
        )
    return pages


def slot_limit_hint(page_size: int, given: str, page_bytes: int = 0, fixed_bytes: int = 0) -> str:
    """What to pass instead of a size past ``MAX_SLOTS``, in the argument the caller gave: a
    ``num_pages`` the allocator takes (it also caps pages at 2**31 - 1, and needs two), else a
    smaller ``page_size``."""
    most = min(MAX_SLOTS // page_size, MAX_PAGES)
    if most < 2:
        return f"page_size={page_size} leaves room for fewer than 2 pages: use page_size <= {MAX_SLOTS // 2}"
    if given == "num_slots":
        return f"use at most num_slots={most * page_size}"
    if given in ("memory_bytes", "memory_fraction") and page_bytes:
        return f"use at most memory_bytes={fixed_bytes + most * page_bytes} (num_pages={most})"
    return f"use at most num_pages={most}"
