"""An 'sglang-unified' row names the TreeCore SGLang actually built, so Rust- and Python-tree rows
stay apart when JSON from the torch 2.14 environment (Rust TreeCore) is reused elsewhere.

Runs where SGLang's radix cache imports (skips with the reason otherwise). With torch 2.15 the
default selection resolves to the Python tree; in the torch 2.14 environment of
docs/benchmarks.md ("Prefix caching") it resolves to Rust, and these tests check that too.
"""

from __future__ import annotations

import re

import pytest
import torch

from kvpool.bench.drivers import sglang_prefix
from kvpool.bench.prefix import PREFIX
from kvpool.bench.prefix.trace import PrefixTraceConfig, generate
from kvpool.bench.trace import Dist

_WHY = sglang_prefix.SGLangPrefixDriver.skip_reason()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "sglang importable")

ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
CORE_CLASS = {"rust": "RustUnifiedTreeCore", "python": "UnifiedTreeCore"}
SMALL = dict(system_len=Dist(64, 256), user_len=Dist(16, 64), output=Dist(4, 16), pressure_output=Dist(4, 16),
             turns=Dist(2, 3), think_steps=Dist(1, 3), parallel_prompt=Dist(64, 256))


def _rust_tree_core_supported() -> bool:
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())  # type: ignore[union-attr]
    return (2, 11) <= (major, minor) <= (2, 14)


@pytest.mark.parametrize("page_size", [1, 16])
def test_python_selection_is_reported_as_python(monkeypatch, page_size):
    monkeypatch.setenv(ENV, "python")
    driver = sglang_prefix.SGLangUnifiedPrefixDriver(PrefixTraceConfig("system", 1 << 14, 4, page_size))
    assert type(driver.tree.tree_core).__name__ == "UnifiedTreeCore"
    assert driver.backend() == "UnifiedRadixCache, python TreeCore (UnifiedTreeCore)"
    assert sglang_prefix.tree_core_backend(page_size) == "python"


@pytest.mark.parametrize("page_size", [1, 16])
def test_default_selection_row_names_the_tree_it_ran(monkeypatch, page_size):
    monkeypatch.delenv(ENV, raising=False)  # SGLang's default: "rust", falling back where it cannot load
    resolved = sglang_prefix.tree_core_backend(page_size)
    kind = resolved.split()[0]
    if _rust_tree_core_supported():
        assert kind == "rust", resolved  # the torch 2.14 environment: the Rust extension must load
    else:
        assert kind == "python" and "outside the Rust TreeCore support range" in resolved, resolved
    cfg = PrefixTraceConfig("chat", 1 << 14, 8, page_size, steps=20, warmup=5, seed=3, **SMALL)
    row = PREFIX.replay(sglang_prefix.SGLangUnifiedPrefixDriver, generate(cfg))
    assert row.backend == f"UnifiedRadixCache, {kind} TreeCore ({CORE_CLASS[kind]})"
    assert row.held_pages_end == 0 and row.consistent and row.total_hit_tokens > 0, row
