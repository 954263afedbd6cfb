"""The request records SGLang's radix caches read, with only the fields their calls touch.

SGLang's own ``Req`` needs a running scheduler; its cache calls (``match_prefix``,
``checkpoint``, ``free_kv_row``, ``prefix_device_indices``) read these fields only.
"""

from __future__ import annotations

from array import array
from typing import Any


class KvRecord:
    """The ``req.kv`` record fields RadixCache reads (no sliding window here)."""

    __slots__ = ("req_pool_idx", "cache_protected_len", "cache_inserted_len", "swa_evict_floor")

    def __init__(self, row: int) -> None:
        self.req_pool_idx = row
        self.cache_protected_len = 0
        self.cache_inserted_len = 0
        self.swa_evict_floor = 0

    def get_evicted_seqlen(self, component_type: Any) -> int:
        return 0

    def swa_dead_lo(self, page_size: int) -> int:
        return 0


class RequestRecord:
    """The request fields the caches' checkpoint / free_kv_row / prefix_device_indices read."""

    __slots__ = ("kv", "origin_input_ids", "full_untruncated_fill_ids", "extra_key", "cache_salt", "priority",
                 "lock", "last_node", "prefix_len", "seq_len", "session", "session_id", "kv_rotation_base",
                 "to_finish", "done")

    def __init__(self, row: int, prompt: array, full: array) -> None:
        self.kv = KvRecord(row)
        self.origin_input_ids = prompt
        self.full_untruncated_fill_ids = full
        self.extra_key = None
        self.cache_salt = None
        self.priority = 0
        self.lock: Any = None
        self.last_node: Any = None
        self.prefix_len = 0
        self.seq_len = len(prompt)
        self.session = None  # no streaming session
        self.session_id = None
        self.kv_rotation_base = None  # no logical-page KV sharding
        self.to_finish = None
        self.done = False

    def finished(self) -> bool:
        return self.done


__all__ = ["KvRecord", "RequestRecord"]
