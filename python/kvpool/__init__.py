"""kvpool: a Rust-accelerated KV-cache memory pool for LLM inference engines.

Layers, each calling only the one below it: ``KVPool`` (torch tensors, tables,
grad-mode safety) and ``DecodeGraphRunner`` -> ``kvpool.kernels`` (Triton) ->
``kvpool._core`` (the Rust ``SlotAllocator``: ownership and free lists).
"""

from importlib import metadata as _metadata

from kvpool._core import (
    ContextTooLongError,
    InvalidArgumentError,
    InvalidHandleError,
    InvariantError,
    KVPoolError,
    PoolExhaustedError,
    PoolStats,
    SlotAllocator,
    TooManyRequestsError,
)
from kvpool.cuda_graph import DecodeGraphRunner
from kvpool.errors import (
    LayerIndexError,
    ReservedSlotError,
    SlotRangeError,
    TensorDeviceError,
    TensorDtypeError,
    TensorShapeError,
    TritonUnavailableError,
)
from kvpool.handles import ROW_MASK, handle_row
from kvpool.modes import Finding, audit, mutable, persistent
from kvpool.pool import ExtendResult, KVPool, PageTable

try:
    __version__ = _metadata.version("kvpool")
except _metadata.PackageNotFoundError:  # imported from a source tree without an install
    __version__ = "0+unknown"

__all__ = [
    # allocator (Rust core) and its errors
    "ContextTooLongError",
    "InvalidArgumentError",
    "InvalidHandleError",
    "InvariantError",
    "KVPoolError",
    "PoolExhaustedError",
    "PoolStats",
    "ROW_MASK",
    "SlotAllocator",
    "TooManyRequestsError",
    "handle_row",
    # torch layer
    "ExtendResult",
    "KVPool",
    "PageTable",
    "LayerIndexError",
    "ReservedSlotError",
    "SlotRangeError",
    "TensorDeviceError",
    "TensorDtypeError",
    "TensorShapeError",
    "TritonUnavailableError",
    # grad-mode safety
    "Finding",
    "audit",
    "mutable",
    "persistent",
    # CUDA-graph decode
    "DecodeGraphRunner",
    "__version__",
]
