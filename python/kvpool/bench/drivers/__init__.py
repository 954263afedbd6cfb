"""Allocator drivers: kvpool and the real SGLang / vLLM allocators when installed.

Baselines are imported lazily (vLLM's import alone takes seconds) and skipped
with a one-line reason when their package is missing; they are never faked.
"""

from __future__ import annotations

import importlib

from kvpool.bench.drivers.base import Driver

# name -> (module, class); order is the report's column order.
_REGISTRY: dict[str, tuple[str, str]] = {
    "kvpool": ("kvpool.bench.drivers.kvpool_driver", "KVPoolDriver"),
    "sglang-token": ("kvpool.bench.drivers.sglang_driver", "SGLangTokenDriver"),
    "sglang-paged": ("kvpool.bench.drivers.sglang_driver", "SGLangPagedDriver"),
    "vllm-blockpool": ("kvpool.bench.drivers.vllm_driver", "VLLMBlockPoolDriver"),
}
ALL = list(_REGISTRY)
BASELINES = [n for n in ALL if n != "kvpool"]


def load(names: list[str]) -> tuple[list[type[Driver]], list[str]]:
    """Driver classes for ``names`` that can run here, and one line per skipped one."""
    unknown = [n for n in names if n not in _REGISTRY]
    if unknown:
        raise ValueError(f"unknown allocator(s) {unknown}; choose from {ALL}")
    found: list[type[Driver]] = []
    skipped: list[str] = []
    for name in names:
        module_name, cls_name = _REGISTRY[name]
        module = importlib.import_module(module_name)
        ok, why = getattr(module, "available", lambda: (True, ""))()
        if ok:
            found.append(getattr(module, cls_name))
        else:
            skipped.append(f"skipping {name}: {why}")
    return found, skipped


__all__ = ["ALL", "BASELINES", "Driver", "load"]
