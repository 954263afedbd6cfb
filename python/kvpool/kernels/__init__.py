"""Triton kernels that move K/V in place by slot id, with torch-facing wrappers.

Every wrapper is one kernel launch on CUDA tensors, and capture-safe: it reads
only tensor metadata on the host (no .item(), no allocation except gather_kv
without `out=`), never autotunes, and compiles one specialization per distinct
(dtype, shape class, n) — warm up before CUDA-graph capture. On CPU tensors the
wrappers run the same semantics with torch ops, so callers need no branch;
with TRITON_INTERPRET=1 set before this package is imported, CPU tensors go
through the Triton kernels via the interpreter instead (that is how the
kernels are tested without a GPU).
"""

from kvpool.kernels._common import INTERPRET, KernelArgumentError
from kvpool.kernels.copy import copy_slots
from kvpool.kernels.gather import gather_kv
from kvpool.kernels.req_table import write_req_to_token
from kvpool.kernels.store import store_kv

__all__ = [
    "INTERPRET",
    "KernelArgumentError",
    "copy_slots",
    "gather_kv",
    "store_kv",
    "write_req_to_token",
]
