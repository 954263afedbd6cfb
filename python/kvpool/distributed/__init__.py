"""kvpool beyond one process, on torch.distributed (NCCL on GPUs, gloo on CPUs).

- Tensor parallelism: ``KVPool(..., tp_rank=, tp_size=)`` holds this rank's KV
  heads; ``tp_pool`` builds it with seeds agreed across the group and wraps it
  in ``TPPool``, which checks that every rank's allocator made the same
  decisions (``RankDivergenceError`` names the first rank that did not).
- Disaggregation: ``send_request(pool, ...)`` / ``recv_request(pool, ...)``
  (also ``kvpool.send_request`` / ``kvpool.recv_request``, which load this
  package on first use) move one request's K/V between pools, page-granular
  and batched.
- ``page_descriptors``: the same pages as ``(addr, len, device)`` rows for NIXL
  or Mooncake. Details and guarantees: docs/distributed.md.
"""

from kvpool.distributed.errors import RankDivergenceError, TransferError, TransferRejectedError, TransferTimeoutError
from kvpool.distributed.kv_transfer import TransferStats, recv_request, recv_request_stats, send_request
from kvpool.distributed.pages import contiguous_runs, page_descriptors
from kvpool.distributed.tp import TPPool, agree_seed, tp_pool
from kvpool.heads import HeadShard, shard_kv_heads

__all__ = [
    "HeadShard",
    "RankDivergenceError",
    "TPPool",
    "TransferError",
    "TransferRejectedError",
    "TransferStats",
    "TransferTimeoutError",
    "agree_seed",
    "contiguous_runs",
    "page_descriptors",
    "recv_request",
    "recv_request_stats",
    "send_request",
    "shard_kv_heads",
    "tp_pool",
]
