"""vLLM's KV-event schema as msgspec structs, for readers without vLLM.

The classes mirror ``vllm/distributed/kv_events.py`` (vLLM 0.33): the same
names, fields, field order and msgspec options (tagged events encoded as maps,
the batch as an array), so a payload decodes the same way with these classes
or with vLLM's own. kvpool's publisher does not build them (it encodes in
native code, ``kvpool._core.encode_kv_events``); they are what a consumer such
as ``kvpool.router`` decodes into.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpool.extras import require

if TYPE_CHECKING:  # the structs are msgspec.Structs to type checkers (require() returns Any)
    import msgspec
else:
    msgspec = require("msgspec", "events", "kvpool.events")

# A block hash on the wire: kvpool sends 16 bytes (the 128-bit chain hash,
# big-endian); vLLM sends 32-byte SHA-256 digests or 64-bit ints.
ExternalBlockHash = bytes | int

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events (tagged by class name under ``type``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def decoder() -> msgspec.msgpack.Decoder[KVEventBatch]:
    """A msgpack decoder of KVEventBatch payloads (reuse it: building one costs)."""
    return msgspec.msgpack.Decoder(KVEventBatch)


__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEventBatch",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "decoder",
]
