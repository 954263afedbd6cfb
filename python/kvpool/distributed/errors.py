"""Typed errors of the distributed layer (all ``KVPoolError`` subclasses).

They live in ``kvpool.errors`` (so ``import kvpool`` offers them without
loading ``torch.distributed``); this module re-exports them.
"""

from __future__ import annotations

from kvpool.errors import RankDivergenceError, TransferError, TransferRejectedError, TransferTimeoutError

__all__ = ["RankDivergenceError", "TransferError", "TransferRejectedError", "TransferTimeoutError"]
