"""Typed errors of the distributed layer (all ``KVPoolError`` subclasses)."""

from __future__ import annotations

from kvpool._core import KVPoolError

__all__ = ["RankDivergenceError", "TransferError", "TransferRejectedError", "TransferTimeoutError"]


class RankDivergenceError(KVPoolError):
    """Tensor-parallel ranks no longer agree on the allocator's decisions.

    ``rank`` is the first rank (in group order) whose digest differs from the
    group's first rank; ``ranks`` lists every differing rank.
    """

    def __init__(self, message: str, rank: int = -1, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.rank, self.ranks = rank, ranks


class TransferError(KVPoolError):
    """Moving a request between pools failed: a peer died, timed out or broke the protocol.

    The pool on the side that raises is left as it was (a half-received
    request is closed again). After this error the process group's
    point-to-point channel to that peer is in an unknown state: rebuild the
    group before the next transfer.
    """


class TransferTimeoutError(TransferError):
    """The peer did not answer within the transfer's timeout."""


class TransferRejectedError(TransferError):
    """The destination refused the request before any K/V moved (no room, or an
    incompatible pool); both pools are unchanged. ``reason`` is the
    destination's status code name (``"exhausted"``, ``"too_many_requests"``,
    ``"context_too_long"``, ``"incompatible"``)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason
