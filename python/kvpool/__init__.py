"""kvpool: a Rust-accelerated KV-cache memory pool for LLM inference engines."""

from kvpool._core import (
    ContextTooLongError,
    InvalidArgumentError,
    InvalidHandleError,
    InvariantError,
    KVPoolError,
    PoolExhaustedError,
    SlotAllocator,
    TooManyRequestsError,
)

__all__ = [
    "ContextTooLongError",
    "InvalidArgumentError",
    "InvalidHandleError",
    "InvariantError",
    "KVPoolError",
    "PoolExhaustedError",
    "SlotAllocator",
    "TooManyRequestsError",
    "handle_row",
]

ROW_MASK = 0xFFFFFFFF


def handle_row(handle: int) -> int:
    """Row of ``handle`` in a request-to-token table (its low 32 bits)."""
    return int(handle) & ROW_MASK
