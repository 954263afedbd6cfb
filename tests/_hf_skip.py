"""Skip, rather than error, where kvpool's transformers integration does not import.

``pytest.importorskip`` catches only ``ModuleNotFoundError`` from pytest 9 on (its ``exc_type=``
came in 8.2, and the test extra allows pytest 7). transformers on a torch it has switched off
(before 2.6), and kvpool's own check of transformers' version, raise a plain ``ImportError``:
on such a stack the HF tests have nothing to test, which is a skip, not an error.
"""

from __future__ import annotations

import importlib
import types

import pytest

MODULE = "kvpool.integrations.transformers"


def require_hf() -> types.ModuleType:
    """kvpool's transformers integration, or a skip of the calling test (or module) that says why not."""
    try:
        return importlib.import_module(MODULE)
    except ImportError as e:
        pytest.skip(f"{MODULE} does not import here: {e}", allow_module_level=True)
