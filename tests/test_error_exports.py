"""Every exception class kvpool defines, anywhere in the package or in ``_core``, is
importable from ``kvpool`` and from ``kvpool.errors`` as the same class, and is a
``KVPoolError``: an engine catches any of them without knowing where it is raised."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import kvpool
import kvpool.errors
from kvpool import KVPoolError

PKG = Path(kvpool.__file__).resolve().parent


def _defined_in_source() -> dict[str, str]:
    """Class name -> file, for each class of the package whose bases name an exception.

    Read from the source, so a module that needs an optional dependency
    (msgspec, zmq, transformers, the baselines) is covered without importing it.
    """
    classes: dict[str, tuple[str, list[str]]] = {}
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases]
                classes[node.name] = (str(path.relative_to(PKG)), bases)
    known = {n for n, c in vars(kvpool.errors).items() if inspect.isclass(c) and issubclass(c, BaseException)}
    known |= {"Exception", "BaseException", "ValueError", "RuntimeError", "TypeError", "KeyError",
              "LookupError", "OSError", "ImportError", "Warning", "UserWarning", "TimeoutError"}
    found: dict[str, str] = {}
    grew = True
    while grew:  # a class whose base is an exception class found so far is one too
        grew = False
        for name, (where, bases) in classes.items():
            if name not in found and any(b in known or b in found or b.endswith(("Error", "Exception")) for b in bases):
                found[name], grew = where, True
    return found


def _defined_at_runtime() -> set[type]:
    """Exception classes of every kvpool module that imports here (and of ``_core``)."""
    out = set()
    mods = [kvpool._core]
    for info in pkgutil.walk_packages([str(PKG)], prefix="kvpool."):
        if info.name.endswith("__main__"):
            continue
        try:
            mods.append(importlib.import_module(info.name))
        except ImportError:  # an optional dependency: the source scan covers its classes
            continue
    for m in mods:
        for obj in vars(m).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__.startswith("kvpool"):
                out.add(obj)
    return out


def test_the_scans_find_every_kind_of_error():
    names = set(_defined_in_source()) | {c.__name__ for c in _defined_at_runtime()}
    # one of each origin: the Rust core, the torch layer, the kernels, kvpool.distributed
    assert {"PoolExhaustedError", "TensorShapeError", "KernelArgumentError", "TransferRejectedError",
            "RankDivergenceError"} <= names


@pytest.mark.parametrize("name", sorted(set(_defined_in_source()) | {c.__name__ for c in _defined_at_runtime()}))
def test_every_error_is_exported_from_kvpool_and_kvpool_errors(name):
    top, errors = getattr(kvpool, name, None), getattr(kvpool.errors, name, None)
    assert top is not None, f"kvpool.{name} is missing"
    assert errors is not None, f"kvpool.errors.{name} is missing"
    assert top is errors
    assert name in kvpool.__all__ and name in kvpool.errors.__all__
    assert issubclass(top, KVPoolError)


def test_runtime_classes_are_the_exported_ones():
    """No module keeps a second class of the same name (``except`` would miss it)."""
    for cls in _defined_at_runtime():
        assert getattr(kvpool.errors, cls.__name__) is cls, f"{cls.__module__}.{cls.__name__}"


def test_distributed_and_kernel_modules_re_export_the_same_classes():
    from kvpool.distributed import errors as dist_errors
    from kvpool.kernels import KernelArgumentError

    assert dist_errors.TransferError is kvpool.TransferError
    assert dist_errors.RankDivergenceError is kvpool.RankDivergenceError
    assert KernelArgumentError is kvpool.KernelArgumentError
    assert issubclass(kvpool.TransferTimeoutError, kvpool.TransferError)
    assert issubclass(kvpool.KernelArgumentError, kvpool.InvalidArgumentError)
