"""One home per contract: ``SlotAllocator``'s docstrings (the pymethods' own, which
``_core.pyi`` repeats word for word, see test_allocator_stubs.py) are the only
statement of its calls' arguments and errors. ``KVPool``'s call of the same name
refers to it and states only what the pool adds, so the two cannot drift:

- every forwarded method's docstring names ``SlotAllocator.<name>``;
- it restates none of the errors the allocator's ``Raises:`` lists (the pool
  lists only errors it adds, such as ``TensorDeviceError``), and no ``Args:``;
- every forwarded counter's docstring is the allocator's, taken at import.
"""

from __future__ import annotations

import inspect
import re

import pytest

import kvpool
from kvpool import KVPool, SlotAllocator

ERRORS = {n for n, c in vars(kvpool.errors).items() if inspect.isclass(c) and issubclass(c, BaseException)}


def _forwarded() -> tuple[list[str], list[str]]:
    methods, counters = [], []
    for name in sorted(dir(KVPool)):
        if name.startswith("_") or not hasattr(SlotAllocator, name):
            continue
        member = inspect.getattr_static(KVPool, name)
        (counters if isinstance(member, property) else methods).append(name)
    return methods, counters


METHODS, COUNTERS = _forwarded()


def _raises(doc: str) -> set[str]:
    """Error class names listed under ``Raises:``."""
    m = re.search(r"^\s*Raises:\s*$(.*?)(?=^\s*\w+:\s*$|\Z)", doc, re.MULTILINE | re.DOTALL)
    return {e for e in re.findall(r"\b(\w+Error)\b", m.group(1)) if e in ERRORS} if m else set()


def test_the_pool_forwards_the_calls_engines_use():
    assert {"open", "extend", "admit", "truncate", "close", "cache", "fork", "open_with_prefix",
            "page_table", "lengths", "check", "take_events"} <= set(METHODS)
    assert {"free_pages", "used_pages", "open_requests", "dropped_events"} <= set(COUNTERS)


@pytest.mark.parametrize("name", METHODS)
def test_a_forwarding_docstring_refers_to_the_allocator(name):
    doc = inspect.getdoc(getattr(KVPool, name)) or ""
    assert f"SlotAllocator.{name}``" in doc, f"KVPool.{name} should say: See ``SlotAllocator.{name}``"


@pytest.mark.parametrize("name", METHODS)
def test_a_forwarding_docstring_restates_none_of_the_allocators_contract(name):
    pool_doc = inspect.getdoc(getattr(KVPool, name)) or ""
    core_doc = getattr(SlotAllocator, name).__doc__ or ""
    restated = sorted(_raises(core_doc) & {e for e in re.findall(r"\b(\w+Error)\b", pool_doc)})
    assert not restated, f"KVPool.{name} restates SlotAllocator.{name}'s errors {restated}"
    assert not re.search(r"^\s*Args:\s*$", pool_doc, re.MULTILINE), f"KVPool.{name} restates the allocator's Args"


@pytest.mark.parametrize("name", COUNTERS)
def test_a_forwarded_counter_has_the_allocators_docstring(name):
    assert inspect.getattr_static(KVPool, name).__doc__ == inspect.getattr_static(SlotAllocator, name).__doc__


def test_the_rule_would_catch_a_restated_error():
    assert _raises("x\n\nRaises:\n    InvalidHandleError: stale.\n    TensorDeviceError: capture.\n") == {
        "InvalidHandleError", "TensorDeviceError"}
    assert _raises(SlotAllocator.extend.__doc__ or "") >= {"InvalidHandleError", "PoolExhaustedError"}
