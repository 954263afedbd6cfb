"""``eager_only``: a module's function that runs eagerly while ``torch.compile`` traces its
caller (``torch.compiler.disable``), the wrapper made on first use.

``torch.compiler.disable`` imports ``torch._dynamo``, which takes about as long as importing
torch itself (1.4 s here). Made at import, the wrappers made every ``import kvpool`` pay that,
though they only ever run while Dynamo traces (their callers test
``torch.compiler.is_compiling()`` first), when Dynamo is loaded anyway; a router, a metrics
process or a pool without ``torch.compile`` never needs it.

``eager_only`` gives torch's own lazy form of it, ``torch._disable_dynamo`` (what torch uses
inside itself to the same end; torch 2.4 on): a function Dynamo never steps into, whatever it
traces (a graph break, as for ``torch.compiler.disable``), which makes the disabled function at
its first call. It is the same object for good, so a trace's guards on it hold: a pool built
before ``torch.compile`` loaded Dynamo compiles its callers once, as with a wrapper made at
import.

``EagerOnly`` is the fallback for a torch without that function: a placeholder whose wrapper,
once made, replaces it in its module's namespace, so a trace calls the disabled function itself.
A pool's construction makes them all when Dynamo is already loaded (``prepare``); one made
inside a trace (a pool built before anything loaded Dynamo) changes what the trace's guards saw,
so its caller compiles once more at the next call.

Callers pass the arguments that change from call to call (a layer index, the rows) to the
wrapper in one tuple, ``_write_eager(self, *(layer, slots, k, v), strict=strict)``. A model
step whose layer loop breaks the graph runs eagerly, and Dynamo compiles ``write`` as a frame of
its own. At the break to the wrapper, torch 2.4 guards every value on the stack: ``layer``
by value (0 and 1 are always specialised there) and each tensor by its size. That frame then
compiled once per layer and batch size, 30 frames for an 8-layer step. Values inside a tuple
are passed on unguarded: the frame compiles once. Torch 2.15 compiles that frame one time fewer too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["EagerOnly", "eager_only", "prepare"]

_PENDING: list[EagerOnly] = []


def eager_only(namespace: dict[str, Any], name: str, fn: Callable[..., Any]) -> Any:
    """What ``namespace[name]`` holds: ``fn`` run eagerly under ``torch.compile`` (module doc)."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else EagerOnly(namespace, name, fn)


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
