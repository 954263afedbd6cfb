"""Prefix-cache drivers: kvpool's and the real SGLang / vLLM caches when installed.

Baselines are imported lazily and skipped with a one-line reason when their
package (or, for kvpool, its shared-pages API) is missing; they are never faked.
"""

from __future__ import annotations

import importlib

from kvpool.bench.prefix_drivers.base import PrefixDriver

# name -> (module, class); order is the report's row order.
_REGISTRY: dict[str, tuple[str, str]] = {
    "kvpool": ("kvpool.bench.prefix_drivers.kvpool_prefix", "KVPoolPrefixDriver"),
    "sglang": ("kvpool.bench.prefix_drivers.sglang_prefix", "SGLangPrefixDriver"),
    "sglang-unified": ("kvpool.bench.prefix_drivers.sglang_prefix", "SGLangUnifiedPrefixDriver"),
    "vllm": ("kvpool.bench.prefix_drivers.vllm_prefix", "VLLMPrefixDriver"),
}
ALL = list(_REGISTRY)
BASELINES = [n for n in ALL if n != "kvpool"]


def load(names: list[str]) -> tuple[list[type[PrefixDriver]], list[str]]:
    """Driver classes for ``names`` that can run here, and one line per skipped one."""
    unknown = [n for n in names if n not in _REGISTRY]
    if unknown:
        raise ValueError(f"unknown allocator(s) {unknown}; choose from {ALL}")
    found: list[type[PrefixDriver]] = []
    skipped: list[str] = []
    for name in names:
        module_name, cls_name = _REGISTRY[name]
        module = importlib.import_module(module_name)
        ok, why = module.available()
        if ok:
            found.append(getattr(module, cls_name))
        else:
            skipped.append(f"skipping {name}: {why}")
    return found, skipped


__all__ = ["ALL", "BASELINES", "PrefixDriver", "load"]
