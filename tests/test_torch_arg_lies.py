"""CPU torch tensors given as integer arguments are read without trusting
anything Python code can change: a TorchFunctionMode or a monkeypatch that
lies about a tensor's numel, contiguity, dim, dtype, data pointer, device
or negative bit gets a correct result or a typed error, never a read
outside the tensor's memory.

Every case runs in a child process, so that an out-of-bounds read that
crashes fails the test instead of killing pytest; each case prints its
name before it starts, so a crash names the case that caused it."""

import subprocess
import sys
import textwrap

import pytest

# The cases' shared prelude: a lying mode and a fresh allocator per case.
PRELUDE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch
    from torch.overrides import TorchFunctionMode
    import kvpool

    def answer_of(func):
        # A getter (dtype, is_cpu) arrives as the __get__ of its descriptor.
        owner = getattr(func, "__self__", None)
        if getattr(func, "__name__", "") == "__get__" and owner is not None:
            return getattr(owner, "__name__", "")
        return getattr(func, "__name__", "")

    class Lie(TorchFunctionMode):
        # Answers every call named in `lies` with the lie (a value, or a
        # function of the tensor); everything else is answered honestly.
        def __init__(self, **lies):
            super().__init__()
            self.lies = lies
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = answer_of(func)
            if name in self.lies and args and type(args[0]) is torch.Tensor:
                lie = self.lies[name]
                return lie(args[0]) if callable(lie) else lie
            return func(*args, **(kwargs or {}))

    def pool(n=4):
        a = kvpool.SlotAllocator(64, max_requests=8, max_context_len=64)
        h = a.open(n)
        a.extend(h, 1)
        return a, h

    def state(a, h):
        return [a.lengths(x).tolist()[0] if a.is_open(x) else None for x in h]

    def case(name):
        print("CASE", name, flush=True)

    def result(value):
        print("RESULT", repr(value), flush=True)

    def refused(call):
        try:
            call()
        except kvpool.KVPoolError as e:
            return type(e).__name__
        return "accepted"
    """
)


# How the bindings get a tensor's layout from torch: its DLPack C exchange
# API, or (a torch without one) the `_to_dlpack` capsule, or neither (then
# numpy). Taking the functions away before the first tensor arrives picks
# the path, as an older torch would (torch 2.4 has no exchange API: popped if there).
EXPORTS = {
    "view": "",
    "capsule": "vars(torch._C).pop('_dlpack_exchange_api', None)\n",
    "numpy": "vars(torch._C).pop('_dlpack_exchange_api', None)\ndel torch._C._to_dlpack\n",
}


def run_cases(body: str, export: str = "view") -> dict:
    """Runs the prelude and `body` in a fresh interpreter; returns each case's RESULT."""
    r = subprocess.run(
        [sys.executable, "-c", PRELUDE + EXPORTS[export] + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    results, current = {}, None
    for line in r.stdout.splitlines():
        if line.startswith("CASE "):
            current = line[5:]
        elif line.startswith("RESULT "):
            results[current] = eval(line[7:])
    assert r.returncode == 0, f"case {current!r} ended the process (rc {r.returncode}): {r.stderr[-3000:]}"
    return results


@pytest.mark.parametrize("export", ["view", "capsule"])
def test_a_lying_numel_neither_crashes_nor_leaks_memory_into_messages(export):
    got = run_cases(
        """
        case("close under numel=10**8")
        a, h = pool()
        with Lie(numel=10**8):
            a.close(torch.tensor([h[0]]))
        result(state(a, h))

        case("lengths under numel=1000")
        a, h = pool()
        a.extend(h, [0, 1, 2, 3])
        t = torch.tensor(h[1:3])
        with Lie(numel=1000):
            got = a.lengths(t).tolist()
        result(got)

        case("error message under numel=1000")
        a, h = pool()
        a.close(h[:1])
        stale = torch.tensor([h[0]])
        try:
            a.extend(stale, 1)
        except kvpool.InvalidHandleError as e:
            honest = str(e)
        with Lie(numel=1000):
            try:
                a.extend(stale, 1)
                lied = "accepted"
            except kvpool.KVPoolError as e:
                lied = str(e)
        result(lied == honest)
        """,
        export,
    )
    assert got == {
        "close under numel=10**8": [None, 1, 1, 1],
        "lengths under numel=1000": [2, 3],
        "error message under numel=1000": True,
    }


@pytest.mark.parametrize("export", ["view", "capsule"])
def test_lies_about_layout_and_type_are_ignored(export):
    got = run_cases(
        """
        case("is_contiguous lie on base[::2]")
        a, h = pool()
        with Lie(is_contiguous=True):
            a.extend(torch.tensor(h)[::2], 1)
        result(state(a, h))

        case("dim lie on a 2-D tensor")
        a, h = pool(3)
        with Lie(dim=1):
            r = refused(lambda: a.extend(h, torch.ones(3, 1, dtype=torch.int64)))
        result((r, state(a, h)))

        case("dim lie on a 1-D tensor")
        a, h = pool(3)
        with Lie(dim=2):
            a.extend(h, torch.tensor([1, 2, 0]))
        result(state(a, h))

        case("dtype lie: int32 called int64")
        a, h = pool(3)
        with Lie(dtype=torch.int64):
            a.extend(h, torch.tensor([2, 0, 1], dtype=torch.int32))
        result(state(a, h))

        case("dtype lie: int64 called int8")
        a, h = pool(3)
        with Lie(dtype=torch.int8):
            a.extend(h, torch.tensor([1, 0, 2]))
        result(state(a, h))

        case("data_ptr lie: another tensor's memory")
        a, h = pool(3)
        other = torch.tensor([5, 5, 5])
        with Lie(data_ptr=other.data_ptr()):
            a.extend(h, torch.tensor([1, 0, 3]))
        result(state(a, h))

        case("data_ptr lie: a wild pointer")
        a, h = pool(3)
        with Lie(data_ptr=8):
            a.extend(h, torch.tensor([0, 2, 0]))
        result(state(a, h))
        """,
        export,
    )
    assert got == {
        "is_contiguous lie on base[::2]": [2, 1, 2, 1],
        "dim lie on a 2-D tensor": ("InvalidArgumentError", [1, 1, 1]),
        "dim lie on a 1-D tensor": [2, 3, 1],
        "dtype lie: int32 called int64": [3, 1, 2],
        "dtype lie: int64 called int8": [2, 1, 3],
        "data_ptr lie: another tensor's memory": [2, 1, 4],
        "data_ptr lie: a wild pointer": [1, 3, 1],
    }


def test_lies_about_device_and_negative_bit_are_refused():
    got = run_cases(
        """
        case("is_cpu lie on a meta tensor")
        a, h = pool(3)
        meta = torch.empty(3, dtype=torch.int64, device="meta")
        with Lie(is_cpu=True):
            r = refused(lambda: a.extend(h, meta))
        result((r, state(a, h)))

        case("is_neg lie on a negative view of handles")
        a, h = pool(3)
        # Stored as the handles, read as their negatives: no valid handle.
        neg = torch._neg_view(torch.tensor(h))
        with Lie(is_neg=False):
            r = refused(lambda: a.extend(neg, 1))
        result((r, state(a, h)))

        case("is_neg lie on a negative view of counts")
        a, h = pool(3)
        neg = torch._neg_view(torch.tensor([-1, -2, -1]))  # reads [1, 2, 1]
        with Lie(is_neg=False):
            r = refused(lambda: a.extend(h, neg))
        result((r, state(a, h)))
        """
    )
    assert got["is_cpu lie on a meta tensor"] == ("InvalidArgumentError", [1, 1, 1])
    r, lengths = got["is_neg lie on a negative view of handles"]
    assert r != "accepted" and lengths == [1, 1, 1]
    # Refused by name, or read as what the view means: never the stored values.
    assert got["is_neg lie on a negative view of counts"] in [
        ("InvalidArgumentError", [1, 1, 1]),
        ("accepted", [2, 3, 2]),
    ]


@pytest.mark.parametrize(
    "method, lie",
    [("numel", "10**8"), ("is_contiguous", "True"), ("data_ptr", "8"), ("dim", "1"), ("is_neg", "False")],
)
def test_monkeypatched_tensor_methods_are_not_trusted(method, lie):
    got = run_cases(
        f"""
        case("monkeypatched {method}")
        a, h = pool()
        base = torch.tensor(h)
        torch.Tensor.{method} = lambda self, *args: {lie}
        a.extend(base[::2], torch.tensor([3, 1]))
        a.close(torch.tensor([h[3]]))
        result(state(a, h))
        """
    )
    assert got == {f"monkeypatched {method}": [4, 1, 2, None]}


@pytest.mark.parametrize("export", ["view", "capsule", "numpy"])
def test_tensors_are_read_without_calling_their_python_methods(export):
    # A CPU int tensor is read in place through torch's C export (either
    # form): it never reaches numpy's conversion, which calls the tensor's
    # Python-level __array__. With neither export the numpy path takes it,
    # and names what went wrong there. Negative views always go to numpy.
    got = run_cases(
        """
        def refuse(self, *args, **kwargs):
            raise RuntimeError("__array__ called")
        torch.Tensor.__array__ = refuse

        case("plain, offset and strided tensors")
        a, h = pool()
        base = torch.tensor([7, *h])
        r = refused(lambda: a.extend(base[1::2], torch.tensor([1, 2], dtype=torch.int32)))
        result((r, state(a, h)))

        case("a negative view")
        a, h = pool(3)
        r = refused(lambda: a.extend(h, torch._neg_view(torch.tensor([-1, -1, -1]))))
        result((r, state(a, h)))
        """,
        export,
    )
    read = ("accepted", [2, 1, 3, 1]) if export != "numpy" else ("InvalidArgumentError", [1, 1, 1, 1])
    assert got == {"plain, offset and strided tensors": read, "a negative view": ("InvalidArgumentError", [1, 1, 1])}


def test_torch_functions_replaced_by_python_code_are_not_used():
    # The C functions are taken only if they are torch's builtins: a Python
    # replacement in place before the first tensor arrives (one that would
    # describe another tensor) sends every tensor to the numpy path.
    got = run_cases(
        """
        other = torch.tensor([9, 9, 9, 9])
        real = torch._C._to_dlpack
        vars(torch._C).pop("_dlpack_exchange_api", None)
        torch._C._to_dlpack = lambda t: real(other)

        case("a replaced _to_dlpack")
        a, h = pool()
        a.extend(h, torch.tensor([1, 0, 2, 0]))
        result(state(a, h))
        """
    )
    assert got == {"a replaced _to_dlpack": [2, 1, 3, 1]}
