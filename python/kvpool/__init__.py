"""kvpool: a Rust-accelerated KV-cache memory pool for LLM inference engines.

Layers, each calling only the one below it: ``kvpool.distributed``,
``kvpool.integrations``, the demo and the benchmarks -> ``KVPool`` (torch
tensors, tables, grad-mode safety) and ``DecodeGraphRunner`` ->
``kvpool.kernels`` (Triton) -> ``kvpool._core`` (the Rust ``SlotAllocator``:
ownership and free lists; ``GroupedAllocator`` for pools of layer groups). ``import kvpool`` loads none of the first layer.

Without torch (``pip install --no-deps kvpool``) the Rust allocator, the handles'
helpers and every exception still import; a name of the torch layer then raises an
ImportError that says to install torch.
"""

from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

from kvpool._core import DEFAULT_PRIORITY, MAX_PRIORITY, GroupedAllocator, PoolStats, SlotAllocator
from kvpool.errors import (
    ContextTooLongError,
    CopyRefusedError,
    DuplicateSlotError,
    IncompleteForwardError,
    InvalidArgumentError,
    InvalidHandleError,
    InvariantError,
    KernelArgumentError,
    KVPoolError,
    LayerIndexError,
    PoolExhaustedError,
    PublisherClosedError,
    RankDivergenceError,
    RequestSwappedOutError,
    ReservedSlotError,
    RollbackUnavailableError,
    RowsChangedError,
    SlotRangeError,
    TensorDeviceError,
    TensorDtypeError,
    TensorShapeError,
    TooManyRequestsError,
    TransferError,
    TransferRejectedError,
    TransferTimeoutError,
    TritonUnavailableError,
)
from kvpool.handles import ROW_MASK, handle_row

if TYPE_CHECKING:  # loaded on first use by __getattr__ (they need torch.distributed)
    from kvpool.distributed.kv_transfer import recv_request as recv_request
    from kvpool.distributed.kv_transfer import send_request as send_request

# The names below need torch. A router or scheduler that only uses the allocator may run
# where torch is not installed: those names then raise an ImportError saying what to install
# (see __getattr__) instead of `import kvpool` failing deep inside the torch layer.
_TORCH_NAMES = frozenset({"DecodeGraphRunner", "ExtendResult", "Finding", "KVPool", "PageTable", "audit",
                          "mutable", "persistent", "send_request", "recv_request"})
_no_torch: ModuleNotFoundError | None = None
try:
    import torch as _torch  # noqa: F401
except ModuleNotFoundError as _e:  # torch itself absent; a broken torch install still raises its own error
    if _e.name != "torch":
        raise
    _no_torch = _e
else:
    from kvpool.cuda_graph import DecodeGraphRunner
    from kvpool.modes import Finding, audit, mutable, persistent
    from kvpool.pool import ExtendResult, KVPool, PageTable
    from kvpool.validate import init_signature as _init_signature

    # help(kvpool.KVPool) and inspect show the pool's parameters, not the (*args, layer_types,
    # **kwargs) of the __new__ that hands layer_types= calls to HybridKVPool.
    KVPool.__signature__ = _init_signature(KVPool, layer_types="Sequence[str] | None")  # type: ignore[attr-defined]

try:
    __version__ = _metadata.version("kvpool")
except _metadata.PackageNotFoundError:  # imported from a source tree without an install
    __version__ = "0+unknown"

__all__ = [
    # allocator (Rust core)
    "DEFAULT_PRIORITY",
    "MAX_PRIORITY",
    "GroupedAllocator",
    "PoolStats",
    "ROW_MASK",
    "SlotAllocator",
    "handle_row",
    # torch layer
    "ExtendResult",
    "KVPool",
    "PageTable",
    # every exception (kvpool.errors)
    "ContextTooLongError",
    "CopyRefusedError",
    "DuplicateSlotError",
    "IncompleteForwardError",
    "InvalidArgumentError",
    "InvalidHandleError",
    "InvariantError",
    "KernelArgumentError",
    "KVPoolError",
    "LayerIndexError",
    "PoolExhaustedError",
    "PublisherClosedError",
    "RankDivergenceError",
    "RequestSwappedOutError",
    "ReservedSlotError",
    "RollbackUnavailableError",
    "RowsChangedError",
    "SlotRangeError",
    "TensorDeviceError",
    "TensorDtypeError",
    "TensorShapeError",
    "TooManyRequestsError",
    "TransferError",
    "TransferRejectedError",
    "TransferTimeoutError",
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
if _no_torch is not None:  # `from kvpool import *` takes what works without torch
    __all__ = [name for name in __all__ if name not in _TORCH_NAMES]


def __getattr__(name: str) -> Any:
    if _no_torch is not None and name in _TORCH_NAMES:
        raise ImportError(
            f"kvpool.{name} needs torch, which is not installed: pip install 'torch>=2.4' (a CPU-only "
            "build is enough for pools on 'cpu'). Without torch only the Rust allocator "
            "(kvpool.SlotAllocator, GroupedAllocator), handle_row and the exceptions work."
        ) from _no_torch
    # send_request / recv_request need torch.distributed: load kvpool.distributed
    # on first use only (and not for ``from kvpool import *``, hence not in
    # __all__), so ``import kvpool`` stays single-process.
    if name in ("send_request", "recv_request"):
        from kvpool.distributed import kv_transfer

        return getattr(kv_transfer, name)
    raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
