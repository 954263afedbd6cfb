"""Compile kvpool's Triton kernels for a CUDA target on a machine without a GPU, and
read the PTX: which global loads/stores are vectorised, and whether slot ids stay
64-bit through the address arithmetic.

A wrapper (store_kv, gather_kv, copy_slots) is called with CPU tensors while its
kernel object is swapped for a recorder, so the test compiles exactly the
arguments and constexprs the wrapper would launch with — including Triton's
specialisation of pointers on 16-byte alignment and of ints on divisibility by
16 (CPU allocations are 64-byte aligned, like the CUDA caching allocator's).
The recorded call then goes through Triton's own binder and compiler for the
given target; only the launch, which needs a driver, is skipped.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import triton  # type: ignore[import-untyped]

Launch = tuple[Any, tuple[Any, ...], dict[str, Any]]  # (grid, args, kwargs)


def cuda_target_unavailable(arch: int = 90) -> str | None:
    """Why this Triton build cannot compile for CUDA sm_<arch>, or None when it can."""
    try:
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
    except ImportError as e:  # pragma: no cover - depends on the install
        return f"triton {triton.__version__} has no pluggable backends: {e}"
    if "nvidia" not in backends:
        return f"triton {triton.__version__} was built without the NVIDIA backend ({sorted(backends)})"
    import inspect

    from triton.runtime import jit
    if "backend" not in inspect.signature(jit.create_function_from_signature).parameters \
            or not hasattr(jit.JITFunction, "_pack_args"):
        # Triton 3.0 (torch 2.4's): _pack below calls the binder and _pack_args of later Tritons.
        return f"triton {triton.__version__} predates the JIT binder these tests drive (create_function_from_signature " \
               "with a backend, JITFunction._pack_args)"
    try:
        make_backend(GPUTarget("cuda", arch, 32))
    except Exception as e:  # noqa: BLE001 - any failure means "cannot target CUDA"
        return f"triton {triton.__version__} cannot make a CUDA sm_{arch} backend: {e}"
    return None


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.calls: list[Launch] = []

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.calls.append((grid, args, kwargs))

        return launch


@contextmanager
def recording(module: Any, kernel_name: str) -> Iterator[_Recorder]:
    """Swap `module.<kernel_name>` for a recorder and force the wrapper's Triton path on CPU."""
    from kvpool.kernels import _common

    rec = _Recorder(getattr(module, kernel_name))
    saved_use = _common.use_triton
    setattr(module, kernel_name, rec)
    _common.use_triton = lambda t: True
    try:
        yield rec
    finally:
        setattr(module, kernel_name, rec.fn)
        _common.use_triton = saved_use


def _pack(fn: Any, backend: Any, args: tuple[Any, ...], kwargs: dict[str, Any]):
    """(options, signature, constexprs, attrs) for one launch, as JITFunction.run builds them."""
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    return fn._pack_args(backend, kwargs, bound, spec, opts)


def compile_launch(fn: Any, launch: Launch, arch: int = 90) -> tuple[str, list[str]]:
    """PTX of `fn` compiled for CUDA sm_<arch> with a recorded launch's arguments,
    and the names of its runtime (non-constexpr) parameters in PTX parameter order."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend

    _, args, kwargs = launch
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    options, signature, constexprs, attrs = _pack(fn, backend, args, dict(kwargs))
    kernel = compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    runtime = [name for name, ty in signature.items() if ty != "constexpr"]
    return kernel.asm["ptx"], runtime


# ----- reading PTX -----------------------------------------------------------------

_INSTR = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)\s*(.*?);\s*$")
_REG = re.compile(r"%[a-z]+\d+")
_REG32 = re.compile(r"%r\d+")  # Triton's PTX: %r = 32-bit, %rd = 64-bit, %rs = 16-bit, %p = predicate


def instructions(ptx: str) -> list[tuple[str, list[str]]]:
    """(opcode, operand strings) of every instruction, in order (directives, labels,
    braces of inline-asm blocks and debug sections are skipped)."""
    out = []
    for line in ptx.splitlines():
        m = _INSTR.match(line.split("//", 1)[0])
        if not m or m.group(1).startswith("."):
            continue
        ops = [o.strip() for o in re.split(r",(?![^{]*})", m.group(2)) if o.strip()]
        out.append((m.group(1), ops))
    return out


def global_accesses(ptx: str) -> Counter:
    """Counts of global load/store opcodes, e.g. {'ld.global.v4.b32': 2, 'st.global.b16': 16}."""
    return Counter(op for op, _ in instructions(ptx) if op.startswith(("ld.global", "st.global")))


def access_bytes(op: str) -> int:
    """Bytes one thread moves with a global ld/st opcode: 'st.global.v4.b32' -> 16."""
    m = re.search(r"(?:\.v(\d))?\.[bsuf](\d+)$", op)
    if not m:
        raise ValueError(f"not a sized access: {op}")
    return int(m.group(1) or 1) * int(m.group(2)) // 8


def _regs(ops: list[str]) -> list[str]:
    return [r for o in ops for r in _REG.findall(o)]


def _dests(op: str, ops: list[str]) -> list[str]:
    if op.startswith(("st.", "bar", "ret", "bra", "red.", "prefetch")) or not ops:
        return []
    return _REG.findall(ops[0])


def _srcs(op: str, ops: list[str]) -> list[str]:
    return _regs(ops[1:]) if _dests(op, ops) else _regs(ops)


def slot_value_flow(ptx: str, param_index: int) -> list[tuple[str, list[str], set[str]]]:
    """Follow the values loaded through PTX parameter `param_index` (a slot-id pointer).

    Returns every instruction that consumes a slot-derived value, with its operands
    and which of its source registers are slot-derived. Derivation follows
    arithmetic, conversions and selects; it stops at comparisons (a predicate
    carries no magnitude) and at loads (what a slot-derived address loads is data)."""
    instrs = instructions(ptx)
    pname = re.compile(rf"_param_{param_index}\]")
    addr: set[str] = set()
    tainted: set[str] = set()
    for op, ops in instrs:  # the pointer parameter, its address arithmetic, its loads
        srcs = set(_srcs(op, ops))
        if op.startswith("ld.param") and pname.search(" ".join(ops)):
            addr.update(_dests(op, ops))
        elif op.startswith("ld.global") and srcs & addr:
            tainted.update(_dests(op, ops))
        elif not op.startswith(("ld.", "setp")) and srcs & addr:
            addr.update(_dests(op, ops))
    uses = []
    for op, ops in instrs:
        hit = set(_srcs(op, ops)) & tainted
        if not hit:
            continue
        uses.append((op, ops, hit))
        if not op.startswith(("ld.", "st.", "setp")):
            tainted.update(_dests(op, ops))
    return uses


_NARROW_PRODUCT = re.compile(r"^(mul|mad)\.(lo|hi)\.[su]32$|^shl\.b32$")
_DIV32 = re.compile(r"^(div|rem)\.[su]32$")


def narrowed_slot_uses(ptx: str, param_index: int) -> list[str]:
    """Slot-derived values squeezed into 32 bits on their way to an address: a 32-bit
    product (slot * stride overflows past 2^31 elements) or a 64 -> 32-bit truncation.
    Empty is good.

    Allowed: 32-bit selects/min/max of an int32 slot (value-preserving), and the
    truncation LLVM emits to bypass a slow 64-bit division (`cvt.u32.u64` feeding
    only `div.u32`/`rem.u32`, taken at run time only when both operands fit)."""
    uses = slot_value_flow(ptx, param_index)
    consumers: dict[str, list[str]] = {}
    for op, ops in instructions(ptx):
        for r in _srcs(op, ops):
            consumers.setdefault(r, []).append(op)
    bad = []
    for op, ops, hit in uses:
        if op.startswith(("ld.", "st.", "setp")):
            continue
        text = f"{op} {', '.join(ops)}"
        if _NARROW_PRODUCT.match(op):
            bad.append(text)
            continue
        wide_src = any(not _REG32.fullmatch(r) for r in hit)
        dests32 = [d for d in _dests(op, ops) if _REG32.fullmatch(d)]
        if wide_src and dests32:
            if op.startswith("cvt.") and all(_DIV32.match(c) for d in dests32 for c in consumers.get(d, [])):
                continue
            bad.append(text)
    return bad


def wide_slot_products(ptx: str, param_index: int) -> list[str]:
    """64-bit multiplies (or shifts) of slot-derived values: the slot * stride terms."""
    wide = re.compile(r"^(mul|mad)\.(lo\.[su]64|wide\.[su]32)$|^shl\.b64$")
    return [f"{op} {', '.join(ops)}" for op, ops, _ in slot_value_flow(ptx, param_index) if wide.match(op)]
