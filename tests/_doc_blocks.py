"""The ```python blocks of README.md and docs/*.md, and how to run one (tests/test_doc_examples.py).

A block runs as the doc shows it, compiled under the doc's own file name and line
numbers (a traceback points into the doc), after a setup that supplies the names
the doc leaves to the reader and before a check of what its prose claims. Where
a block needs a GPU, the test swaps in a CPU version by exact text replacement;
each replaced text must occur in the block, so a doc edit cannot slip past.
"""

from __future__ import annotations

import re
import traceback
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(path: Path) -> list[tuple[int, str]]:
    """(line of the block's first code line, code) for every ```python block of ``path``."""
    text = path.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in FENCE.finditer(text)]


def substitute(code: str, subs: tuple[tuple[str, str], ...], where: str) -> str:
    """``code`` with each (doc text, CPU text) replaced; a doc text that does not occur fails."""
    for old, new in subs:
        assert old in code, f"{where}: the CPU version replaces {old!r}, which the block no longer has"
        assert old.count("\n") == new.count("\n"), f"{where}: {old!r} -> {new!r} would shift the doc's line numbers"
        code = code.replace(old, new)
    return code


def _exec(code: str, filename: str, line: int, ns: dict[str, Any]) -> None:
    exec(compile("\n" * (line - 1) + code, filename, "exec"), ns)


def run(steps: list[dict[str, Any]], ns: dict[str, Any]) -> dict[str, Any]:
    """Run a case's steps in ``ns``: each ``{"kind", "file", "line", "code", "keep"}``.

    A ``setup`` step's new module bindings are dropped (the block must import what it
    uses) except the names in ``keep``; ``cleanup`` steps run whatever happened.
    """
    cleanups = [s for s in steps if s["kind"] == "cleanup"]
    try:
        for s in steps:
            if s["kind"] == "cleanup":
                continue
            before = dict(ns)
            _exec(s["code"], s["file"], s["line"], ns)
            if s["kind"] == "setup":
                for name, value in list(ns.items()):
                    if (isinstance(value, types.ModuleType) and name not in s["keep"]
                            and before.get(name) is not value):
                        del ns[name]
    finally:
        for s in cleanups:
            try:
                _exec(s["code"], s["file"], s["line"], ns)
            except NameError:
                pass  # the case failed before it made what the cleanup closes
    return ns


def on_ranks(rank: int, world: int, cases: dict[str, list[dict[str, Any]]]) -> dict[str, str | None]:
    """Every case on this rank of a gloo group (tests/_dist.py): case id -> traceback, or None."""
    import pytest

    out: dict[str, str | None] = {}
    for key, steps in cases.items():
        try:
            run(steps, {"__name__": "__doc_example__", "rank": rank, "world": world, "pytest": pytest})
            out[key] = None
        except BaseException:  # each case reports its own failure; the next one still runs
            out[key] = traceback.format_exc()
    return out
