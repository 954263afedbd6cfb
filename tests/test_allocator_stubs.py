"""Keeps python/kvpool/_core.pyi true to the compiled module with mypy.stubtest.

stubtest runs on a scratch copy of just the extension and its stub (under an
empty `kvpool` package): checking it in place would make mypy analyse
kvpool/__init__ and with it all of torch, which takes a minute."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import kvpool._core

STUB = Path(__file__).resolve().parents[1] / "python" / "kvpool" / "_core.pyi"


def stubtest(tmp_path: Path, stub_text: str) -> subprocess.CompletedProcess:
    pkg = tmp_path / "kvpool"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_core.pyi").write_text(stub_text)
    shutil.copy(kvpool._core.__file__, pkg / Path(kvpool._core.__file__).name)
    (tmp_path / "mypy.ini").write_text(f"[mypy]\ncache_dir = {tmp_path / 'cache'}\n")
    return subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "--mypy-config-file", "mypy.ini", "kvpool._core"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_stub_matches_runtime(tmp_path):
    r = stubtest(tmp_path, STUB.read_text())
    assert r.returncode == 0, r.stdout + r.stderr


def test_stubtest_catches_a_wrong_stub(tmp_path):
    """Guards the guard: a stub with a renamed parameter must fail."""
    text = STUB.read_text()
    assert "def close(self, handles: " in text
    r = stubtest(tmp_path, text.replace("def close(self, handles: ", "def close(self, requests: "))
    assert r.returncode != 0 and "close" in r.stdout, r.stdout + r.stderr


def _runtime_doc(obj) -> str:
    """A member's runtime docstring without its leading ``name(args) -> ...`` line."""
    import inspect
    import re

    doc = inspect.getdoc(obj) or ""
    first, _, rest = doc.partition("\n\n")
    return (rest if re.match(r"^\w+\(.*\)", first) and "\n" not in first else doc).strip()


def is_overload(fn) -> bool:
    import ast

    return any(isinstance(d, ast.Name) and d.id == "overload" for d in fn.decorator_list)


def first_of(methods, name):
    return next(m for m in methods if m.name == name)


def test_stub_docstrings_match_runtime_docstrings():
    """The stub's docstrings are the Rust doc comments (what help() shows), word for word."""
    import ast
    import inspect

    tree = ast.parse(STUB.read_text())
    checked = 0
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in ("SlotAllocator", "GroupedAllocator")):
        runtime_cls = getattr(kvpool._core, cls.name)
        assert inspect.cleandoc(ast.get_docstring(cls) or "") == (inspect.getdoc(runtime_cls) or "").strip()
        methods = [n for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
        for fn in methods:
            stub_doc = ast.get_docstring(fn)
            if is_overload(fn) and fn is not first_of(methods, fn.name):
                # Only the first of a method's @overloads carries its docstring.
                assert stub_doc is None, f"{cls.name}.{fn.name}: a docstring on a later overload"
                continue
            assert stub_doc, f"{cls.name}.{fn.name} has no docstring in the stub"
            assert stub_doc.strip() == _runtime_doc(getattr(runtime_cls, fn.name)), fn.name
            checked += 1
    assert checked >= 60
    # Every other class the stub declares says what help() says of it.
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name not in ("SlotAllocator", "GroupedAllocator")):
        runtime_cls = getattr(kvpool._core, cls.name)
        if isinstance(runtime_cls, type) and not issubclass(runtime_cls, BaseException) and runtime_cls.__doc__:
            assert inspect.cleandoc(ast.get_docstring(cls) or "") == inspect.cleandoc(runtime_cls.__doc__), cls.name


def test_help_headers_name_every_parameter():
    """help() shows a method's first doc line as its call form; SlotAllocator.fork's read
    ``fork(handle, n=1)`` and open_with_prefix's ``open_with_prefix(tokens, lengths,
    salt=None)``, leaving out the ``table=`` both take. Each header names the parameters
    of the method's signature, in order."""
    import re

    checked = 0
    for cls in (kvpool._core.SlotAllocator, kvpool._core.GroupedAllocator):
        for name in (n for n in dir(cls) if not n.startswith("_")):
            method = getattr(cls, name)
            sig = getattr(method, "__text_signature__", None)
            m = re.match(rf"^{name}\(([^)]*)\)", (method.__doc__ or "").split("\n", 1)[0])
            if sig is None or m is None:
                continue
            def names(args: str) -> list[str]:
                return [a.split("=")[0].strip() for a in args.split(",")
                        if a.strip() and a.strip() not in ("$self", "/", "*")]
            assert names(m.group(1)) == names(sig.strip("()")), (cls.__name__, name, m.group(0), sig)
            checked += 1
    assert checked >= 40
