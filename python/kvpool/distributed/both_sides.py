"""What both sides of a request transfer share besides the wire format (``protocol``):
the ``TransferStats`` each returns, and the pool lock each holds while it holds the
request's pages. Apart from ``kv_transfer`` (the send side, and the public entry points)
and ``kv_receive`` (the receive side) so that the receive side need not import
``kv_transfer``, which re-exports it."""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

__all__ = ["TransferStats"]


class TransferStats(NamedTuple):
    """What one transfer did: ``handle`` (the request on dst; src: the one sent),
    ``pages`` of the request, ``cached_pages`` dst already had (not sent),
    ``bytes`` of K/V moved, ``messages`` sent and received, ``seconds`` taken."""

    handle: int
    pages: int
    cached_pages: int
    bytes: int
    messages: int
    seconds: float


def _pool_lock(pool: Any) -> Any:
    """The pool's lock (``KVPool`` and proxies of it), or nothing for a pool without one."""
    lock = getattr(pool, "_lock", None)
    return lock if lock is not None else contextlib.nullcontext()
