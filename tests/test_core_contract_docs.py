"""One home per contract, the Rust side: each core call's doc comment
(``rust/kvpool-core/src/allocator/``) names the ``PoolError`` variants it returns
under ``Errors``, and the binding's docstring (which ``_core.pyi`` repeats word for
word, see test_allocator_stubs.py, and ``KVPool`` refers to, see
test_forwarding_docs.py) names the exceptions it raises under ``Raises:``. The
binding maps each variant to one class (``to_pyerr`` in
``rust/kvpool-py/src/errors.rs``). These tests read all three and check that the
two lists agree through that map: every error the core documents is in the
Python docstring, and the docstring claims no core error the core does not
document (``InvalidArgumentError`` aside: argument conversion raises it too).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvpool import GroupedAllocator, SlotAllocator

ROOT = Path(__file__).resolve().parents[1]
CORE_OPS = ROOT / "rust" / "kvpool-core" / "src" / "allocator"
CORE_GROUPS = ROOT / "rust" / "kvpool-core" / "src" / "groups"
ERRORS_RS = ROOT / "rust" / "kvpool-py" / "src" / "errors.rs"

# Python method -> the core call it forwards to.
CALLS = {
    "open": "open",
    "extend": "extend",
    "admit": "admit_into",
    "truncate": "truncate",
    "close": "close",
    "cache": "cache",
    "fork": "fork",
    "open_with_prefix": "open_with_prefix",
    "chain_hashes": "prefix_chain",
    "match_chain_hashes": "match_chain",
    "open_with_chain_hashes": "open_with_chain",
    "swap_out": "swap_out",
    "swap_in": "swap_in",
    "unpin": "unpin",
    "set_clock": "set_clock",
}


# GroupedAllocator's methods -> the core calls (rust/kvpool-core/src/groups/).
GROUPED_CALLS = {
    "open": "open",
    "extend": "extend",
    "admit": "admit",
    "truncate": "truncate",
    "close": "close",
    "cache": "cache",
    "fork": "fork",
    "open_with_prefix": "open_with_prefix",
    "evict": "evict",
}


def variant_classes() -> dict[str, str]:
    """``PoolError`` variant -> Python exception class, from ``to_pyerr``'s match."""
    text = ERRORS_RS.read_text()
    body = text[text.index("pub fn to_pyerr") :]
    arms = re.findall(r"PoolError::(\w+)[^=]*=>\s*(\w+)", body)
    return {v: ("InvalidArgumentError" if cls == "invalid_argument" else cls) for v, cls in arms}


def core_docs(where: Path = CORE_OPS) -> dict[str, str]:
    """Each public core call's doc comment, by name."""
    docs = {}
    for path in sorted(where.glob("*.rs")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"\s*pub fn (\w+)", line)
            if not m:
                continue
            j = i
            while j > 0 and lines[j - 1].strip().startswith("///"):
                j -= 1
            docs[m.group(1)] = " ".join(line.strip().removeprefix("///").strip() for line in lines[j:i])
    return docs


def core_errors(doc: str, variants: dict[str, str]) -> set[str]:
    """The classes of the variants a doc comment names in backticks after ``Errors``."""
    at = doc.find("Errors")
    assert at >= 0, f"no Errors section in: {doc}"
    return {variants[v] for v in re.findall(r"`(\w+)`", doc[at:]) if v in variants}


def python_raises(doc: str) -> set[str]:
    m = re.search(r"^\s*Raises:\s*$(.*?)(?=^\s*\w+:\s*$|\Z)", doc, re.MULTILINE | re.DOTALL)
    assert m, f"no Raises: section in: {doc}"
    return set(re.findall(r"\b(\w+Error)\b", m.group(1)))


def test_every_pool_error_variant_has_its_class():
    variants = variant_classes()
    enum = (ROOT / "rust" / "kvpool-core" / "src" / "error.rs").read_text()
    body = enum[enum.index("pub enum PoolError") :]
    declared = set(re.findall(r"^\s{4}(\w+)\s*[({,]", body[: body.index("\n}")], re.MULTILINE))
    assert declared == set(variants), (declared, variants)
    import kvpool.errors

    assert all(hasattr(kvpool.errors, c) for c in variants.values())


@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_docstring_raises_what_the_core_returns(name):
    variants = variant_classes()
    core = core_errors(core_docs()[CALLS[name]], variants)
    py = python_raises(getattr(SlotAllocator, name).__doc__ or "")
    assert core <= py, f"SlotAllocator.{name} does not document {sorted(core - py)}"
    extra = (py & set(variants.values())) - core - {"InvalidArgumentError"}
    assert not extra, f"SlotAllocator.{name} documents {sorted(extra)}, which the core's {CALLS[name]} never returns"


@pytest.mark.parametrize("name", sorted(GROUPED_CALLS))
def test_the_grouped_docstring_raises_what_the_core_returns(name):
    variants = variant_classes()
    core = core_errors(core_docs(CORE_GROUPS)[GROUPED_CALLS[name]], variants)
    py = python_raises(getattr(GroupedAllocator, name).__doc__ or "")
    assert core <= py, f"GroupedAllocator.{name} does not document {sorted(core - py)}"
    extra = (py & set(variants.values())) - core - {"InvalidArgumentError"}
    assert not extra, f"GroupedAllocator.{name} documents {sorted(extra)}, which the core's {GROUPED_CALLS[name]} never returns"
