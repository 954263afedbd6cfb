"""Optional dependencies: features that need one import it through ``require``,
so ``import kvpool`` never does, and using the feature without it says which
extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` or raise an ImportError naming the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{feature} needs the {module!r} module, which is not installed: "
            f"pip install 'kvpool[{extra}]'"
        ) from e


__all__ = ["require"]
