"""A cache-aware router over several pools, fed only by their KV events
(optional extra ``events``: msgspec, and pyzmq for ``ZmqFeed``).

``Router(num_pools, page_size=, hash_seed=)`` keeps which pool holds which page
hash, ``route(tokens, salt)`` picks the pool with the longest cached prefix
(least loaded among equals); ``feed()`` takes messages in-process and
``ZmqFeed`` subscribes it to the pools' ZMQ publishers. See
docs/events-and-metrics.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what mypy and IDEs see; at runtime __getattr__ imports on first use
    from kvpool.router.event_streams import StreamState as StreamState
    from kvpool.router.index import PageIndex as PageIndex
    from kvpool.router.router import Route as Route
    from kvpool.router.router import Router as Router
    from kvpool.router.zmq_feed import ZmqFeed as ZmqFeed

_LAZY = {
    "Router": "kvpool.router.router",
    "Route": "kvpool.router.router",
    "StreamState": "kvpool.router.event_streams",
    "PageIndex": "kvpool.router.index",
    "ZmqFeed": "kvpool.router.zmq_feed",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvpool.router' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)


__all__ = list(_LAZY)
