"""The one registry of drivers: (workload, allocator name) -> the class that drives it.

A driver module is imported only when its allocator is asked for (vLLM's import
alone takes seconds). A baseline whose package is missing is skipped with a
one-line reason (``Driver.skip_reason``); it is never faked. Which page sizes a
driver runs is ``Driver.supports``. A new workload adds its table here and its
driver modules beside these; nothing else needs to know them.
"""

from __future__ import annotations

import importlib

from kvpool.bench.drivers.base import Driver

# workload -> allocator name -> "module:Class" under kvpool.bench.drivers; the order is the
# report's row order.
_REGISTRY: dict[str, dict[str, str]] = {
    "churn": {
        "kvpool": "kvpool_churn:KVPoolChurnDriver",
        "sglang-token": "sglang_churn:SGLangTokenDriver",
        "sglang-paged": "sglang_churn:SGLangPagedDriver",
        "vllm-blockpool": "vllm_churn:VLLMBlockPoolDriver",
    },
    "prefix": {
        "kvpool": "kvpool_prefix:KVPoolPrefixDriver",
        "sglang": "sglang_prefix:SGLangPrefixDriver",
        "sglang-unified": "sglang_prefix:SGLangUnifiedPrefixDriver",
        "vllm": "vllm_prefix:VLLMPrefixDriver",
        "kvpool-host": "kvpool_prefix:KVPoolHostPrefixDriver",
        "kvpool-host-wt": "kvpool_prefix:KVPoolWriteThroughPrefixDriver",
        "vllm-offload-lru": "vllm_offload_prefix:VLLMOffloadLRUDriver",
        "vllm-offload-arc": "vllm_offload_prefix:VLLMOffloadARCDriver",
    },
    "hybrid": {
        "kvpool": "kvpool_hybrid:KVPoolHybridDriver",
        "vllm": "vllm_hybrid:VLLMHybridDriver",
    },
}


def names(workload: str) -> list[str]:
    """The allocators ``workload`` can replay on, in report order."""
    return list(_REGISTRY[workload])


def driver_class(workload: str, name: str) -> type[Driver]:
    """The driver class for ``name`` (imports its module; raises ValueError for an unknown name)."""
    table = _REGISTRY[workload]
    if name not in table:
        raise ValueError(f"unknown allocator {name!r} for {workload}; choose from {list(table)}")
    module_name, cls_name = table[name].split(":")
    cls: type[Driver] = getattr(importlib.import_module(f"kvpool.bench.drivers.{module_name}"), cls_name)
    return cls


def load(workload: str, wanted: list[str]) -> tuple[list[type[Driver]], list[str]]:
    """Driver classes for ``wanted`` that can run here, and one line per skipped one."""
    unknown = [n for n in wanted if n not in _REGISTRY[workload]]
    if unknown:
        raise ValueError(f"unknown allocator(s) {unknown}; choose from {names(workload)}")
    found: list[type[Driver]] = []
    skipped: list[str] = []
    for name in wanted:
        cls = driver_class(workload, name)
        why = cls.skip_reason()
        if why is None:
            found.append(cls)
        else:
            skipped.append(f"skipping {name}: {why}")
    return found, skipped


__all__ = ["Driver", "driver_class", "load", "names"]
