"""The HF tests skip, not error, where kvpool's transformers integration refuses to import.

On torch < 2.6 transformers switches its torch support off, and kvpool's integration then raises
a plain ImportError saying what to install. From pytest 9 on, ``pytest.importorskip`` lets such an
ImportError through (it catches only ModuleNotFoundError), so the HF test modules errored at
collection on the declared torch floor instead of skipping. ``_hf_skip.require_hf`` is what they
call instead.
"""

from __future__ import annotations

import importlib.abc
import sys

import pytest
from _hf_skip import MODULE, require_hf


class _Refuses(importlib.abc.MetaPathFinder):
    """Makes importing kvpool's transformers integration raise the ImportError an unsupported
    stack raises (the module exists; it refuses)."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name == MODULE:
            raise ImportError("kvpool.integrations.transformers needs transformers>=5.23 with torch>=2.6")
        return None


@pytest.fixture
def refusing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Refuses(), *sys.meta_path])


def test_a_refusing_integration_is_a_skip_with_its_reason(refusing: None) -> None:
    with pytest.raises(pytest.skip.Exception, match="needs transformers>=5.23 with torch>=2.6"):
        require_hf()


def test_a_missing_module_is_a_skip_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    monkeypatch.setitem(sys.modules, "kvpool.integrations.transformers", None)  # import -> ModuleNotFoundError
    with pytest.raises(pytest.skip.Exception, match="does not import here"):
        require_hf()


def test_an_importable_integration_is_returned() -> None:
    pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
    mod = require_hf()  # skips here where this stack refuses it, as the HF tests do
    assert mod.__name__ == MODULE
    assert hasattr(mod, "KVPoolCache")
