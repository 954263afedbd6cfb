"""Launch a compiled Triton kernel through its launcher, once its specialization is known.

``kernel[grid](...)`` re-derives every call's specialization (a type and an alignment
class per argument), hashes it with the options, looks the compiled kernel up and builds
launch metadata before it reaches the launcher. Measured on an H200 host (gVisor, Triton
3.6) for the store kernel's 32 arguments: 22 µs a launch, of which the launcher itself is
about 6. ``KVPool.write`` is one such launch per layer per step, so an eager engine pays
that Python in front of every store.

``CompiledLaunch`` pays Triton's path once per *plan key*, keeps the compiled kernel it
returned, and afterwards calls the launcher itself. The caller builds the key, and it
must determine everything Triton specialises on: each tensor's dtype and whether its
address is a multiple of 16, each integer's value class (1, a multiple of 16, the 32-bit
range), the constexprs and ``num_warps``, and the device. ``KVPOOL_CHECK_LAUNCH=1`` asks
Triton, at every cached launch, which kernel it would have used, and raises
``InvariantError`` if that is not the cached one (the GPU checks run with it).

Triton's own path is kept whenever the shortcut cannot be trusted: under the
interpreter; when a launch hook is installed (profilers such as Proton read launch
metadata; Triton 3.5+ keeps its hooks in always-present, usually empty chains); when the
compiled kernel does not have the launcher interface of Triton 3.2-3.6 (``run``,
``function``, ``packed_metadata``); or with ``KVPOOL_TRITON_LAUNCH=jit``.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from kvpool.errors import InvariantError

__all__ = ["MAX_PLANS", "CompiledLaunch", "Plan", "launch_planned", "raw_stream"]

# Plans and compiled kernels kept per kernel. A pool needs a handful (per dtype, layout
# and batch-size class); callers whose tensors' strides keep changing would otherwise
# grow the caches without bound, so they start over past this many.
MAX_PLANS = 4096

_ENABLED = os.environ.get("KVPOOL_TRITON_LAUNCH", "compiled") != "jit"
_CHECK = os.environ.get("KVPOOL_CHECK_LAUNCH", "") not in ("", "0")

try:  # the raw stream handle Triton's own driver reads (no torch Stream object made)
    raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - a torch without CUDA bindings
    def raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


def _runtime_knobs() -> Any:
    """Triton's ``knobs.runtime`` (launch hooks), or None where Triton has no knobs."""
    try:
        from triton import knobs  # type: ignore[import-untyped]

        return knobs.runtime
    except (ImportError, AttributeError):
        return None


#: Compile options of every kernel here. Triton 3.9 warns at a process's first compile that
#: its FP-fusion default turns off in 3.10: these kernels copy, convert and scale (no
#: multiply-add to fuse), so their code is the same either way, and asking explicitly keeps
#: that warning out of an engine's log.
OPTIONS = types.MappingProxyType({"enable_fp_fusion": False})  # (read-only: copy.py and page_copy.py import it)


def _no_hook(hook: Any) -> bool:
    """Whether a launch hook slot is empty: None, or (Triton 3.5 on) a ``HookChain`` with
    no calls (the launcher would call it, and compute launch metadata, for nothing)."""
    if hook is None:
        return True
    calls = getattr(hook, "calls", None)
    return isinstance(calls, list) and not calls


class CompiledLaunch:
    """One Triton ``JITFunction`` and the compiled kernels it returned, by plan key.

    ``launch(key, grid, args, num_warps, device)``: ``args`` are every parameter of the
    kernel in signature order, constexprs included (as Triton's launcher receives
    them); ``grid`` has two dimensions; ``device`` is the CUDA device index the
    arguments live on, which must be current.
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._compiled: dict[Hashable, tuple[Any, Any, Any, Any]] = {}
        self._knobs: Any = None
        # Only a compiled JITFunction returns a kernel with a launcher; the interpreter's
        # InterpretedFunction (TRITON_INTERPRET=1) launches eagerly and returns nothing usable.
        self.enabled = _ENABLED and hasattr(fn, "device_caches")
        self.raw_pointers = True  # (launch_kept: the launcher takes ints as addresses)

    def launch(self, key: Hashable, grid: tuple[int, int], args: Sequence[Any], num_warps: int,
               device: int) -> None:
        hit = self._compiled.get(key)
        if hit is not None:
            run, function, metadata, kernel = hit
            rt = self._knobs
            if rt is None or (_no_hook(rt.launch_enter_hook) and _no_hook(rt.launch_exit_hook)):
                if _CHECK:
                    self._check(kernel, grid, args, num_warps)
                try:
                    run(grid[0], grid[1], 1, raw_stream(device), function, metadata, None, None, None, *args)
                    return
                except TypeError:
                    # A launcher that takes other arguments (another Triton's convention) refuses
                    # them before it launches anything: keep Triton's own path from now on.
                    self.enabled = False
                    self._compiled.clear()
        kernel = self.fn[grid](*args, num_warps=num_warps, **OPTIONS)
        if self.enabled and key not in self._compiled:
            self._keep(key, kernel)

    def launch_kept(self, key: Hashable, grid: tuple[int, int], args: Sequence[Any], device: int) -> bool:
        """Launch the kernel kept for ``key`` with ``args`` through its launcher, and True; or
        False with nothing launched wherever ``launch`` would take Triton's path (nothing kept for
        ``key`` yet, a launch hook installed, ``KVPOOL_CHECK_LAUNCH``, a launcher that refused raw
        addresses once). Only the launcher takes an int as a pointer argument (the address itself),
        so a caller may pass ints here, and tensors to ``launch`` when this returns False.
        ``num_warps`` is in the kept kernel's metadata."""
        hit = self._compiled.get(key) if self.enabled and self.raw_pointers else None
        if hit is None or _CHECK:
            return False
        rt = self._knobs
        if not (rt is None or (_no_hook(rt.launch_enter_hook) and _no_hook(rt.launch_exit_hook))):
            return False
        run, function, metadata, _ = hit
        try:
            run(grid[0], grid[1], 1, raw_stream(device), function, metadata, None, None, None, *args)
        except TypeError:
            # (a launcher that wants objects with data_ptr() refuses before it launches anything)
            self.raw_pointers = False
            return False
        return True

    def _keep(self, key: Hashable, kernel: Any) -> None:
        try:
            run, function, metadata = kernel.run, kernel.function, kernel.packed_metadata
        except AttributeError:  # another Triton's CompiledKernel: keep Triton's path
            self.enabled = False
            return
        if not callable(run) or function is None:
            self.enabled = False
            return
        if self._knobs is None:
            self._knobs = _runtime_knobs()
        if len(self._compiled) >= MAX_PLANS:
            self._compiled.clear()
        self._compiled[key] = (run, function, metadata, kernel)

    def _check(self, kernel: Any, grid: tuple[int, int], args: Sequence[Any], num_warps: int) -> None:
        would = self.fn.run(*args, grid=grid, warmup=True, num_warps=num_warps, **OPTIONS)
        if would is not kernel:
            raise InvariantError(
                f"{getattr(self.fn, '__name__', self.fn)}: the cached launch's key does not determine "
                "Triton's specialization (Triton would compile or pick another kernel for these "
                "arguments); launch with KVPOOL_TRITON_LAUNCH=jit and report this")

    def clear(self) -> None:
        self._compiled.clear()

    def __len__(self) -> int:
        return len(self._compiled)


# A plan: (arguments after the pointers and n, rows per program, grid y, num_warps).
Plan = tuple[tuple, int, int, int]


def launch_planned(launch: CompiledLaunch, kernel: Any, plans: dict[tuple, Plan], key: tuple,
                   make_plan: Callable[[], Plan], head: tuple, n: int, on_cuda: bool) -> None:
    """Launch ``kernel`` over ``n`` rows with ``head`` (its pointer arguments), ``n`` and the
    rest of the arguments from ``key``'s plan (made by ``make_plan`` the first time).
    ``kernel`` is the module's kernel as read at the call (the codegen tests swap in a
    recorder); ``key[-1]`` is the device index, current at the call."""
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plan = plans[key] = make_plan()
    tail, rows, grid_y, warps = plan
    args = head + (n,) + tail
    grid = (-(-n // rows), grid_y)
    if kernel is launch.fn and launch.enabled and on_cuda:
        launch.launch(key, grid, args, warps, key[-1])
    else:
        kernel[grid](*args, num_warps=warps, **OPTIONS)
