"""The package's layers: every module imports only from its own layer or lower ones,
and ``import kvpool`` leaves the layer above the pool (``kvpool.distributed``) unloaded.

Read from the source (every import statement, at module level or inside a
function, and every ``"kvpool.x"`` module name given to ``importlib``), so a
lazy import that runs back up is caught as well as an eager one.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvpool

PKG = Path(__file__).resolve().parents[1] / "python" / "kvpool"

# Lowest first. A module's layer is that of its first name under kvpool/.
LAYERS: list[tuple[str, set[str]]] = [
    ("core", {"_core"}),
    ("base", {"errors", "modes", "torch_types", "extras", "handles", "handle_args", "progress", "out_of_memory",
              "_forksafe", "_nopickle", "_values", "_eager"}),
    ("kernels", {"kernels"}),
    ("pool", {"pool", "pool_views", "admission", "sharing", "lifecycle", "rows", "tables", "packed", "staging",
              "streams", "validate", "cuda_graph", "graph_inputs", "graph_outputs", "layout", "heads", "capacity", "metrics", "events",
              "testing", "tiers", "hybrid", "hybrid_copies", "hybrid_ops", "hybrid_plan", "hybrid_queries", "hybrid_rows", "hybrid_tables",
              "hybrid_views", "host_tier", "row_stores", "pool_slots", "row_edits", "extending"}),
    ("above the pool", {"__init__", "__main__", "cli", "distributed", "integrations", "router", "bench", "demo"}),
]
LEVEL = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}


def _top(module: str) -> str | None:
    """``kvpool.kernels.ops`` -> ``kernels``; None for anything outside the package."""
    parts = module.split(".")
    if parts[0] != "kvpool":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path, pkg: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, a module of package ``pkg``."""
    tree = ast.parse(path.read_text(), str(path))
    if pkg is None:
        pkg = ".".join(("kvpool",) + path.relative_to(PKG).parent.parts)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            # `from kvpool import distributed` names a submodule, not an attribute.
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names if mod == "kvpool"]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            v = node.value
            if v.startswith("kvpool.") and v.replace(".", "").replace("_", "").isalnum():
                out.append((node.lineno, v))  # a module named to importlib
    return out


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py"))


def test_every_module_has_a_layer():
    missing = sorted({_top("kvpool." + ".".join(p.relative_to(PKG).with_suffix("").parts)) for p in _modules()}
                     - set(LEVEL))
    assert not missing, f"add {missing} to a layer in LAYERS"


def test_no_import_runs_up_a_layer():
    bad = []
    for path in _modules():
        rel = path.relative_to(PKG).with_suffix("")
        here = LEVEL[_top(".".join(("kvpool",) + rel.parts)) or "__init__"]
        for line, mod in _imports(path):
            top = _top(mod)
            if top is None or top not in LEVEL:
                continue
            if LEVEL[top] > here:
                bad.append(f"python/kvpool/{rel}.py:{line} ({LAYERS[here][0]}) imports {mod} ({LAYERS[LEVEL[top]][0]})")
    assert not bad, "imports that run up a layer:\n" + "\n".join(bad)


def test_the_checker_sees_lazy_relative_and_named_imports(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from kvpool.distributed import kv_transfer\n"
                   "from ..bench import cli\n"
                   "import importlib\nimportlib.import_module('kvpool.demo.engine')\n")
    mods = {m for _, m in _imports(src, pkg="kvpool.kernels")}
    assert {"kvpool.distributed", "kvpool.bench", "kvpool.demo.engine"} <= mods


def _run(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that imports the kvpool these tests import."""
    env = dict(os.environ, PYTHONPATH=str(Path(kvpool.__file__).resolve().parents[1]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          check=False)


@pytest.mark.parametrize("stmt", ["import kvpool", "import kvpool.pool", "from kvpool import KVPool, TransferError"])
def test_import_kvpool_loads_no_distributed_module(stmt):
    code = (f"{stmt}\nimport sys\n"
            "bad = sorted(m for m in sys.modules if m.startswith('kvpool.distributed'))\n"
            "assert not bad, bad\n")
    r = _run(code)
    assert r.returncode == 0, r.stderr[-2000:]


def test_send_request_is_reached_lazily():
    code = ("import sys, kvpool\n"
            "assert 'kvpool.distributed' not in sys.modules\n"
            "from kvpool.distributed import kv_transfer\n"
            "assert kvpool.send_request is kv_transfer.send_request\n"
            "assert kvpool.recv_request is kv_transfer.recv_request\n")
    r = _run(code)
    assert r.returncode == 0, r.stderr[-2000:]
