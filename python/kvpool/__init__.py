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

# --- torch layer: KVPool, grad-mode helpers, typed tensor errors (issue 3) ---
from kvpool.errors import (  # noqa: E402
    LayerIndexError,
    ReservedSlotError,
    SlotRangeError,
    TensorDeviceError,
    TensorDtypeError,
    TensorShapeError,
)
from kvpool.modes import Finding, audit, mutable, persistent  # noqa: E402
from kvpool.pool import ExtendResult, KVPool, PageTable  # noqa: E402

__all__ += [
    "ExtendResult", "Finding", "KVPool", "LayerIndexError", "PageTable", "ReservedSlotError", "SlotRangeError",
    "TensorDeviceError", "TensorDtypeError", "TensorShapeError", "audit", "mutable", "persistent",
]
# --- end issue 3 ---

# --- kernels and CUDA-graph decode runner (issue 4) ---
from kvpool.cuda_graph import DecodeGraphRunner  # noqa: E402

__all__ += ["DecodeGraphRunner"]
# --- end issue 4 ---
