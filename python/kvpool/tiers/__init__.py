"""kvpool.tiers: where a pool's pages go when they leave device memory.

- ``HostStorage``: the page-major host copy of a pool's K/V (pinned on CUDA).
- ``TransferRunner`` / ``TransferBatch``: run one call's offloads, loads and
  copy-on-write copies in the documented order, on a copy stream on CUDA,
  ordered before the step's kernels by events (no host sync).
- ``FileTier`` (a ``TierBackend``) and ``DiskCache``: prefixes kept on disk
  across restarts, stored by chain hash and verified on every read.

The page moves themselves are ``kvpool.kernels.offload_pages`` /
``load_pages``. See docs/tiers.md.
"""

from kvpool.tiers.backend import FORMAT_VERSION, PageRecord, TierBackend, page_key, tier_seed
from kvpool.tiers.disk_cache import DiskCache, DiskStats, shape_fingerprint
from kvpool.tiers.file_tier import FileTier
from kvpool.tiers.host_storage import HostStorage, host_page_bytes, host_pages_for_bytes
from kvpool.tiers.transfers import CudaStreams, TransferBatch, TransferRunner

__all__ = [
    "FORMAT_VERSION",
    "CudaStreams",
    "DiskCache",
    "DiskStats",
    "FileTier",
    "HostStorage",
    "PageRecord",
    "TierBackend",
    "TransferBatch",
    "TransferRunner",
    "host_page_bytes",
    "host_pages_for_bytes",
    "page_key",
    "shape_fingerprint",
    "tier_seed",
]
