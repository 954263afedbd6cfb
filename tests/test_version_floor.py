"""The declared torch floor covers what the package calls: torch.compiler.is_compiling
(torch >= 2.3) and, in the kernels, tl.div_rn and propagate_nan (Triton >= 3.0, which
torch ships from 2.4)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def _floor(requirement_name: str) -> tuple:
    if not PYPROJECT.exists():
        pytest.skip("no pyproject.toml next to the tests (running against an installed copy)")
    text = PYPROJECT.read_text()
    m = re.search(rf'"{requirement_name}\s*>=\s*([0-9.]+)', text)
    assert m, f"pyproject.toml declares no lower bound for {requirement_name}"
    return tuple(int(x) for x in m.group(1).split("."))


def test_torch_floor_is_at_least_2_4():
    assert _floor("torch") >= (2, 4)


def test_installed_versions_have_the_apis_the_floor_promises():
    import torch

    assert callable(torch.compiler.is_compiling)
    triton = pytest.importorskip("triton", reason="triton not installed (CPU-only torch)")
    import triton.language as tl

    assert hasattr(tl, "div_rn") and hasattr(tl, "PropagateNan"), triton.__version__


@pytest.mark.parametrize("version,ok", [("2.3.1", False), ("3.0.0", True), ("3.6.0+git1a2b", True),
                                        ("3.10.0", True)])
def test_too_old_triton_is_a_clear_error(monkeypatch, version, ok):
    """A CUDA pool with Triton < 3.0 fails at construction with TritonUnavailableError
    naming the version, not with an AttributeError deep inside a kernel compile."""
    import types

    import torch

    from kvpool.kernels import _common

    monkeypatch.setattr(_common, "_triton_checked", False)
    monkeypatch.setattr(_common, "_triton_error", None)
    monkeypatch.setattr(_common.importlib, "import_module",
                        lambda name: types.SimpleNamespace(__version__=version))
    if ok:
        _common.require_triton(torch.device("cuda", 0))
    else:
        with pytest.raises(_common.TritonUnavailableError, match=f"triton {version} is older than 3.0"):
            _common.require_triton(torch.device("cuda", 0))
