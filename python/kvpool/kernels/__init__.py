"""kvpool.kernels: the one owner of every K/V and table movement, on every device.

``store_kv``, ``gather_kv``, ``copy_slots``, ``write_req_to_token`` and the
whole-page host transfers ``offload_pages`` / ``load_pages`` run the
Triton kernels on CUDA tensors and the torch implementations (``_ref``, also
the reference the kernels are tested against) on CPU tensors, with the same
semantics, so callers need no branch. Triton is imported on the first CUDA
launch only, so this package imports without it; on CUDA without a usable
Triton a call raises ``TritonUnavailableError`` naming what to install.

On CUDA every call is one launch (``copy_slots``: one per group of like caches)
and capture-safe: it reads only tensor metadata on the host (no .item(), no
allocation except gather_kv without ``out=``), never autotunes, and compiles
one specialization per distinct (dtype, shape class, n) — warm up before
CUDA-graph capture. The page transfers are the exception: they take host page
ids (checked and staged to the device per call), so they run between steps,
never inside a captured graph. With TRITON_INTERPRET=1 set before this package is
imported, CPU tensors go through the Triton kernels via the interpreter
instead (that is how the kernels are tested without a GPU).
"""

from kvpool.kernels._common import INTERPRET, KernelArgumentError, TritonUnavailableError, require_triton
from kvpool.kernels.ops import copy_slots, gather_kv, store_kv, write_req_to_token
from kvpool.kernels.pages import PageTransfer, load_pages, offload_pages

__all__ = [
    "INTERPRET",
    "KernelArgumentError",
    "PageTransfer",
    "TritonUnavailableError",
    "copy_slots",
    "gather_kv",
    "load_pages",
    "offload_pages",
    "require_triton",
    "store_kv",
    "write_req_to_token",
]
