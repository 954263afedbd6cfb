"""``EagerOnly``: a module's function that runs eagerly while ``torch.compile`` traces its
caller (``torch.compiler.disable``), the wrapper made on first use.

``torch.compiler.disable`` imports ``torch._dynamo``, which takes about as long as importing
torch itself (1.4 s here). Made at import, the wrappers made every ``import kvpool`` pay that,
though they only ever run while Dynamo traces (their callers test
``torch.compiler.is_compiling()`` first), when Dynamo is loaded anyway; a router, a metrics
process or a pool without ``torch.compile`` never needs it.

Once made, the wrapper replaces the placeholder in its module's namespace, so a trace calls
the disabled function itself, exactly as a wrapper made at import (a placeholder Dynamo has to
step through costs that trace one more frame). A pool's construction makes them all when Dynamo
is already loaded (``prepare``); one made inside a trace (a pool built before anything loaded
Dynamo) costs that first trace the extra frame and gives the same result.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["EagerOnly", "prepare"]

_PENDING: list[EagerOnly] = []


class EagerOnly:
    """The placeholder of ``namespace[name]``: ``fn`` behind ``torch.compiler.disable``, made at
    the first call or ``prepare()``, which then puts it in ``namespace[name]`` itself."""

    __slots__ = ("namespace", "name", "fn")

    def __init__(self, namespace: dict[str, Any], name: str, fn: Callable[..., Any]) -> None:
        self.namespace, self.name, self.fn = namespace, name, fn
        _PENDING.append(self)

    def make(self) -> Callable[..., Any]:
        made = torch.compiler.disable(self.fn)
        self.namespace[self.name] = made
        return made

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.make()(*args, **kwargs)


def prepare() -> None:
    """Make every wrapper now if Dynamo is loaded (nothing can trace a caller before it is)."""
    if "torch._dynamo" in sys.modules:
        while True:
            # One atomic pop, no check before it: pools built on two threads at once both run
            # this, and a check-then-pop raised IndexError out of the constructor that lost.
            try:
                pending = _PENDING.pop()
            except IndexError:
                return
            pending.make()
