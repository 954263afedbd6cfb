"""Grad-mode safety: ``persistent()``, ``audit()`` and ``mutable()``.

Tensors remember the mode they were born in. One created while
``torch.inference_mode()`` is on is an *inference tensor* forever: an in-place
write to it outside inference mode raises (after the data has already changed),
and ``torch.compile`` cannot guard it because it has no version counter. Grad
mode is thread-local, so "the caller is in inference mode" is never something
a long-lived buffer can rely on. These helpers make long-lived tensors normal by
construction and find the ones that are not.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, overload

import numpy as np
import torch

from kvpool._core import InvalidArgumentError

__all__ = [
    "ERR_INPLACE_INFERENCE",
    "ERR_LEAF_REQUIRES_GRAD",
    "ERR_SAVED_FOR_BACKWARD",
    "ERR_VERSION_COUNTER",
    "Finding",
    "audit",
    "mutable",
    "persistent",
]

# The messages torch raises (checked on torch 2.15; torch appends a hint after
# the first sentence of the in-place one, so match on the prefix).
ERR_INPLACE_INFERENCE = "Inplace update to inference tensor outside InferenceMode is not allowed."
ERR_VERSION_COUNTER = "Inference tensors do not track version counter."
ERR_SAVED_FOR_BACKWARD = "Inference tensors cannot be saved for backward."
ERR_LEAF_REQUIRES_GRAD = "a leaf Variable that requires grad is being used in an in-place operation."

KIND_INFERENCE = "inference tensor"
KIND_REQUIRES_GRAD = "requires grad"


@contextlib.contextmanager
def persistent() -> Iterator[None]:
    """Create long-lived tensors here: normal (not inference) and grad-free.

    The order matters: ``inference_mode(False)`` first, then ``no_grad()``.
    Leaving inference mode restores the grad mode that was on *before* it was
    entered, so the reverse nesting (``no_grad`` then ``inference_mode(False)``)
    turns grad recording back on. Works as a decorator too. Only the current
    thread is affected, and the caller's modes are restored on exit.
    """
    with torch.inference_mode(False), torch.no_grad():
        yield


@dataclasses.dataclass(frozen=True)
class Finding:
    """One tensor that will fail when used as a long-lived, mutable buffer.

    ``error``: the message (prefix) an eager in-place write outside inference
    mode raises (after the data has already changed). For inference tensors
    also ``version_error``: what anything reading the version counter raises
    (``t._version``; torch.compile's guards and mutation tracking in the torch
    versions that read it), and ``autograd_error``: what using it in a
    grad-recording computation raises. Inductor-compiled code may write an
    inference tensor with no error at all (torch 2.15), which is why audit
    looks at ``is_inference()`` rather than waiting for an exception.
    ``fix`` says what to do about it.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    error: str
    version_error: str | None
    autograd_error: str | None
    fix: str

    def __str__(self) -> str:
        text = f"{self.name} {list(self.shape)} {self.dtype}: {self.kind}; in-place write raises {self.error!r}"
        if self.version_error:
            text += f"; version-counter use (torch.compile) raises {self.version_error!r}"
        if self.autograd_error:
            text += f"; autograd raises {self.autograd_error!r}"
        return f"{text}. Fix: {self.fix}"


def _findings_for(name: str, t: torch.Tensor, *, is_parameter: bool) -> list[Finding]:
    out = []
    shape, dtype = tuple(t.shape), t.dtype
    if t.is_inference():
        out.append(
            Finding(
                name, KIND_INFERENCE, shape, dtype, ERR_INPLACE_INFERENCE, ERR_VERSION_COUNTER, ERR_SAVED_FOR_BACKWARD,
                "create it under kvpool.persistent(), or replace it with kvpool.mutable(t)",
            )
        )
    # Parameters are expected to require grad in a training-capable model; a
    # buffer or cache that requires grad is the bug (in-place writes to a leaf
    # raise outside no_grad, and every op on it records autograd history).
    if t.requires_grad and not is_parameter:
        out.append(
            Finding(
                name, KIND_REQUIRES_GRAD, shape, dtype,
                ERR_LEAF_REQUIRES_GRAD if t.is_leaf else "(no error: the write is recorded by autograd)",
                None,
                None,
                "create it under kvpool.persistent() or call .requires_grad_(False)",
            )
        )
    return out


class _Walker:
    """Collects findings from a tree of pools, modules, tensors and containers."""

    def __init__(self, max_depth: int) -> None:
        self.seen: set[int] = set()
        self.findings: list[Finding] = []
        self.max_depth = max_depth

    def tensor(self, name: str, t: torch.Tensor, *, is_parameter: bool = False) -> None:
        if id(t) in self.seen:
            return
        self.seen.add(id(t))
        self.findings.extend(_findings_for(name, t, is_parameter=is_parameter))

    def walk(self, name: str, obj: Any, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            self.tensor(name, obj, is_parameter=isinstance(obj, torch.nn.Parameter))
            return
        if id(obj) in self.seen or depth > self.max_depth:
            return
        self.seen.add(id(obj))
        named_tensors = getattr(obj, "named_tensors", None)
        if isinstance(obj, torch.nn.Module):
            # remove_duplicate=False would report a tied weight twice; the
            # seen-set already drops repeats of the same tensor object.
            for sub, p in obj.named_parameters():
                self.tensor(f"{name}.{sub}", p, is_parameter=True)
            for sub, b in obj.named_buffers():
                self.tensor(f"{name}.{sub}", b)
            # Plain tensor attributes (caches kept outside register_buffer,
            # or in lists/dicts) are invisible to named_buffers() yet fail
            # the same way.
            for mod_name, mod in obj.named_modules():
                prefix = f"{name}.{mod_name}" if mod_name else name
                for attr, value in vars(mod).items():
                    if not attr.startswith("_") and isinstance(value, (torch.Tensor, Mapping, list, tuple)):
                        self.walk(f"{prefix}.{attr}", value, depth + 1)
        elif callable(named_tensors) and hasattr(obj, "allocator"):
            for sub, t in named_tensors() + _kept_for_pool(obj):  # a KVPool
                self.tensor(f"{name}.{sub}", t)
        elif isinstance(obj, Mapping):
            for key, value in obj.items():
                self.walk(f"{name}[{key!r}]", value, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                self.walk(f"{name}[{i}]", value, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            # An engine object (model runner, attention backend) holding
            # tensors as attributes.
            for attr, value in vars(obj).items():
                if not attr.startswith("__"):
                    self.walk(f"{name}.{attr}", value, depth + 1)


# Lookups of tensors kept for a pool outside it, registered by the upper layers that keep
# them (KVPoolCache's pool views, kvpool.distributed's transfer staging) when they are
# imported: this base module may not reach up to them, and importing them here would load
# transformers or torch.distributed.
_KEPT_ELSEWHERE: list[Callable[[Any], list[tuple[str, torch.Tensor]]]] = []


def register_kept_for_pool(lookup: Callable[[Any], list[tuple[str, torch.Tensor]]]) -> None:
    """Have ``audit(pool)`` also walk ``lookup(pool)``: (name, tensor) pairs a module keeps
    for ``pool`` outside it (empty when it keeps none)."""
    _KEPT_ELSEWHERE.append(lookup)


def _kept_for_pool(pool: Any) -> list[tuple[str, torch.Tensor]]:
    """Long-lived tensors kept for a pool outside it, made lazily at first use: the pinned
    ring that stages its host -> device copies (CUDA), and what the modules registered
    with ``register_kept_for_pool`` keep (the staging and layer buffers closed
    ``KVPoolCache``s leave to its next caches, ``kvpool.distributed``'s transfer staging)."""
    out: list[tuple[str, torch.Tensor]] = []
    ring = getattr(getattr(pool, "_to_device", None), "__self__", None)
    for i, slot in enumerate(getattr(ring, "_slots", ())):
        out.append((f"pinned_ring[{i}]", slot.buf))
    for lookup in _KEPT_ELSEWHERE:
        try:
            out += lookup(pool)
        except TypeError:  # a pool that takes no weak reference: nothing is kept for it
            pass
    return out


def audit(*objects: Any, max_depth: int = 4, **named: Any) -> list[Finding]:
    """Report tensors that will fail as mutable long-lived state.

    Walks KV pools, ``nn.Module`` parameters, buffers and tensor attributes,
    plain tensors, dicts / lists / tuples of these and (up to ``max_depth``
    levels) the attributes of other objects. Returns a list of
    :class:`Finding` (empty when all is well): every inference tensor, and
    every non-parameter tensor that requires grad, with its qualified name and
    the error it will raise. Positional objects are named by their type
    (``Linear.weight``); keyword objects by their keyword (``model.weight``).

    Raises:
        InvalidArgumentError: ``max_depth`` is not an int >= 0.
    """
    # A negative depth would skip every object but a bare tensor and report a
    # model full of inference tensors as clean; None would fail mid-walk.
    if isinstance(max_depth, (bool, np.bool_)) or not isinstance(max_depth, (int, np.integer)) or max_depth < 0:
        raise InvalidArgumentError(f"max_depth must be an int >= 0 (levels of attributes and containers to walk), "
                                   f"got {type(max_depth).__name__} {max_depth!r}")
    walker = _Walker(max_depth)
    for i, obj in enumerate(objects):
        if isinstance(obj, torch.Tensor):
            name = f"tensor{i}"
        elif isinstance(obj, (Mapping, list, tuple)):
            name = f"arg{i}"
        else:
            name = type(obj).__name__
        walker.walk(name, obj, 0)
    for name, obj in named.items():
        walker.walk(name, obj, 0)
    return walker.findings


def _normal_copy(t: torch.Tensor) -> torch.Tensor:
    with persistent():
        # clone() outside inference mode yields a normal tensor even when the
        # source is an inference tensor (out-of-place ops on them are allowed).
        copy = t.detach().clone()
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(copy, requires_grad=t.requires_grad)
    return copy


_Module = TypeVar("_Module", bound=torch.nn.Module)


# For type checkers: a Parameter gives a Parameter, a tensor a tensor, a module itself.
@overload
def mutable(obj: torch.nn.Parameter) -> torch.nn.Parameter: ...
@overload
def mutable(obj: torch.Tensor) -> torch.Tensor: ...
@overload
def mutable(obj: _Module) -> _Module: ...
def mutable(obj: Any) -> Any:
    """A normal, grad-free copy of an inference tensor, made outside inference mode.

    Given a tensor, returns a copy (a Parameter stays a Parameter with its
    ``requires_grad``). Given an ``nn.Module``, replaces every inference
    parameter and buffer of it (and its submodules) in place with such a copy
    and returns the module. Safe to call from any grad mode.

    Raises:
        InvalidArgumentError: ``obj`` is neither a tensor nor a module.
    """
    if isinstance(obj, torch.Tensor):
        return _normal_copy(obj)
    if isinstance(obj, torch.nn.Module):
        for mod in obj.modules():
            for pname, p in list(mod._parameters.items()):
                if p is not None and p.is_inference():
                    mod._parameters[pname] = _normal_copy(p)  # type: ignore[assignment]
            for bname, b in list(mod._buffers.items()):
                if b is not None and b.is_inference():
                    mod._buffers[bname] = _normal_copy(b)
        return obj
    raise InvalidArgumentError(f"mutable() takes a torch.Tensor or nn.Module, got {type(obj).__name__}")
