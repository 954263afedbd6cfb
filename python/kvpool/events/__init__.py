"""KV cache events on the wire, in vLLM's format (optional extra ``events``: pyzmq, msgspec).

- ``ZmqEventPublisher(pool, endpoint, *, replay_endpoint=None, topic="", buffer_steps=10000)``:
  ``publish()`` drains the pool's events and sends them as one ``KVEventBatch``
  (ZMQ multipart ``(topic, seq, payload)``); a ROUTER socket replays missed batches.
- ``LocalEventPublisher(pool)``: the same messages, handed over in-process.
- ``kvpool.events.schema``: vLLM's event classes as msgspec structs, for consumers.

The mapping from kvpool's events to vLLM's is documented in
docs/events-and-metrics.md. Names are loaded on first use, so that importing
this package needs neither pyzmq nor msgspec; a feature used without its
dependency raises an ImportError naming the extra to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvpool.events.publisher import END_SEQ, EventPublisher, LocalEventPublisher

if TYPE_CHECKING:  # what mypy and IDEs see; at runtime __getattr__ imports on first use
    from kvpool.events import schema as schema
    from kvpool.events.schema import AllBlocksCleared as AllBlocksCleared
    from kvpool.events.schema import BlockRemoved as BlockRemoved
    from kvpool.events.schema import BlockStored as BlockStored
    from kvpool.events.schema import KVEventBatch as KVEventBatch
    from kvpool.events.zmq_publisher import ZmqEventPublisher as ZmqEventPublisher

_LAZY = {
    "ZmqEventPublisher": "kvpool.events.zmq_publisher",
    "schema": "kvpool.events.schema",
    "KVEventBatch": "kvpool.events.schema",
    "BlockStored": "kvpool.events.schema",
    "BlockRemoved": "kvpool.events.schema",
    "AllBlocksCleared": "kvpool.events.schema",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvpool.events' has no attribute {name!r}")
    m = importlib.import_module(mod)
    return m if name == "schema" else getattr(m, name)


__all__ = ["END_SEQ", "EventPublisher", "LocalEventPublisher", *_LAZY]
