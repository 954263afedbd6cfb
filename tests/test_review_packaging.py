"""How kvpool meets a machine unlike ours: a dependency missing from the environment.

Each case runs in a subprocess that hides a package (``sys.modules[name] = None``
makes ``import name`` raise ModuleNotFoundError, as on a machine without it).
"""

import os
import subprocess
import sys
from pathlib import Path

import kvpool

# The kvpool these tests import (the installed one in CI, where the checkout's python/ has no
# built _core), not necessarily the checkout's.
PYTHON_DIR = str(Path(kvpool.__file__).resolve().parents[1])


def _toml():
    """tomllib (3.11+), or tomli on 3.10: pytest itself requires tomli there, so these checks run
    on the declared Python floor too instead of skipping."""
    try:
        import tomllib
    except ModuleNotFoundError:
        import tomli as tomllib
    return tomllib


def run(code, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


NO_TORCH = """
import sys
sys.modules['torch'] = None          # installed with `pip install --no-deps kvpool`, no torch
import kvpool
assert 'torch' not in [m for m, v in sys.modules.items() if v is not None], 'torch got imported'
a = kvpool.SlotAllocator(num_pages=64, page_size=4, max_requests=8, max_context_len=64)
reqs = a.open(2)
assert list(a.extend(reqs, [3, 5])) == [4, 5, 6, 8, 9, 10, 11, 12]
assert kvpool.handle_row(reqs[1]) >= 0
try:
    a.extend(reqs, [1000, 1])
except kvpool.ContextTooLongError:
    pass
a.check()
msgs = []
for stmt in ('kvpool.KVPool', 'from kvpool import DecodeGraphRunner', 'kvpool.audit', 'kvpool.send_request'):
    try:
        exec(stmt)
    except ImportError as e:
        msgs.append(str(e))
print('|'.join(msgs))
ns = {}
exec('from kvpool import *', ns)
assert 'SlotAllocator' in ns and 'KVPoolError' in ns and 'KVPool' not in ns, sorted(ns)
try:
    kvpool.no_such_name
except AttributeError:
    pass
from kvpool.cli import main
assert main(['--version']) == 0
assert main(['demo']) == 1
from kvpool.bench.__main__ import main as bench_main
assert bench_main(['churn', '--quick']) == 1
"""


def test_allocator_imports_without_torch_and_the_torch_layer_says_what_to_install():
    r = run(NO_TORCH)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    msgs = lines[0].split("|")
    assert len(msgs) == 4, r.stdout
    for name, msg in zip(("KVPool", "DecodeGraphRunner", "audit", "send_request"), msgs):
        assert f"kvpool.{name} needs torch" in msg and "pip install 'torch>=2.4'" in msg, msg
    assert lines[1].startswith("kvpool "), r.stdout  # --version
    assert "kvpool demo: needs torch" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "python -m kvpool.bench: needs torch" in r.stderr, r.stderr


ROUTER_NO_TORCH = """
import sys
sys.modules['torch'] = None          # a router or monitoring process: no torch installed
import numpy as np
import kvpool
from kvpool.events import LocalEventPublisher
from kvpool.router import Router
pools = [kvpool.SlotAllocator(64, 4, 8, 512, hash_seed=21) for _ in range(2)]
pubs = [LocalEventPublisher(p) for p in pools]
router = Router(2, page_size=4, hash_seed=21)
tokens = np.arange(1000, 1013, dtype=np.int64)
h, _ = pools[1].open_with_prefix(tokens, [13])
pools[1].extend(h, 13)
pools[1].cache(h)
for i, pub in enumerate(pubs):
    pub.publish()
    router.feed_many(i, pub.drain())
assert router.match(tokens) == [0, 12], router.match(tokens)
assert router.route(tokens).pool == 1
from kvpool.router import ZmqFeed  # noqa: F401  (pyzmq, msgspec: the test extra)
from kvpool.metrics import KVPoolCollector
assert any(f.name == 'kvpool_pages' for f in KVPoolCollector(pools).collect())
assert 'torch' not in [m for m, v in sys.modules.items() if v is not None], 'torch got imported'
print('routed')
"""


def test_a_router_reads_events_and_routes_without_torch():
    """The events and the router are what a router process imports, often on a machine with no
    torch: both work from the allocator alone."""
    r = run(ROUTER_NO_TORCH)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "routed", r.stdout


def test_a_broken_torch_still_raises_its_own_error():
    """Only an absent torch is deferred: an install that fails inside torch says why at import."""
    r = run("import sys, types\n"
            "class Finder:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch':\n"
            "            raise ImportError('libtorch_cuda.so: cannot open shared object file')\n"
            "sys.meta_path.insert(0, Finder())\n"
            "import kvpool\n")
    assert r.returncode != 0
    assert "libtorch_cuda.so" in r.stderr


def test_bench_plot_without_matplotlib_names_the_extra(tmp_path):
    r = run("import runpy, sys\n"
            "sys.modules['matplotlib'] = None\n"
            "sys.argv = ['kvpool.bench'] + sys.argv[1:]\n"
            "runpy.run_module('kvpool.bench', run_name='__main__')\n",
            "churn", "--quick", "--allocators", "kvpool", "--out", str(tmp_path), "--plot", "c.png", "--json", "c.json")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "c.json").exists() and not (tmp_path / "c.png").exists()
    assert "no plot:" in r.stderr and "pip install 'kvpool[bench]'" in r.stderr, r.stderr


def test_sdist_holds_what_a_build_needs_and_nothing_else(tmp_path):
    """`pip install kvpool` on a platform without a wheel builds from the sdist: it must carry
    both crates, Cargo.lock, the Python package with its stub, and the repository's cargo
    flags (.cargo/config.toml), and leave out the tests, benchmarks and build outputs."""
    import shutil
    import tarfile

    import pytest

    maturin = shutil.which("maturin")
    if maturin is None:
        pytest.skip("maturin is not on PATH (pip builds kvpool in an isolated environment)")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([maturin, "sdist", "-o", str(tmp_path)], cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (sdist,) = tmp_path.glob("kvpool-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in (".cargo/config.toml", "Cargo.toml", "Cargo.lock", "pyproject.toml", "README.md",
                   "rust/kvpool-core/Cargo.toml", "rust/kvpool-py/Cargo.toml", "rust/kvpool-py/src/lib.rs",
                   "python/kvpool/__init__.py", "python/kvpool/_core.pyi", "python/kvpool/py.typed"):
        assert needed in names, needed
    junk = sorted(n for n in names if n.startswith(("tests/", "benchmarks/", "fuzz/", "target/", "docs/"))
                  or n.endswith((".so", ".pyc")) or "__pycache__" in n or ".hypothesis" in n)
    assert not junk, junk


def test_transformers_of_another_major_version_says_what_to_install():
    import importlib.util

    import pytest

    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (the hf extra)")
    r = run("import transformers\n"
            "transformers.__version__ = '4.57.1'   # what an older environment has\n"
            "try:\n"
            "    import kvpool.integrations.transformers\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    assert r.returncode == 0, r.stderr
    assert "found transformers 4.57.1" in r.stdout and "pip install 'kvpool[hf]'" in r.stdout, r.stdout


def test_every_extra_the_docs_name_exists_and_every_extra_is_documented():
    import re

    tomllib = _toml()
    root = Path(__file__).resolve().parents[1]
    extras = set(tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    texts = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "python").rglob("*.py"))]
    named: dict[str, str] = {}
    for path in texts:
        for m in re.finditer(r"(?:kvpool|\.)\[([a-z_-]+)\]", path.read_text()):
            named.setdefault(m.group(1), str(path.relative_to(root)))
    unknown = {name: where for name, where in named.items() if name not in extras}
    assert not unknown, f"extras named in the docs or messages but not in pyproject.toml: {unknown}"
    assert extras <= set(named), f"extras no doc names: {sorted(extras - set(named))}"


def test_the_wheel_version_is_the_crates_version():
    """maturin takes the wheel's version from pyproject.toml; the crates (and the SBOM in the
    wheel) carry Cargo.toml's: the two must not drift apart."""

    tomllib = _toml()
    root = Path(__file__).resolve().parents[1]
    py = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    cargo = tomllib.loads((root / "Cargo.toml").read_text())["workspace"]["package"]["version"]
    assert py == cargo


def test_the_test_extra_installs_on_the_declared_python_floor():
    """requires-python says 3.10, but transformers 5.21+ need Python 3.11: the test extra's
    transformers>=5.23, unmarked, made `pip install '.[test]'` unresolvable on 3.10 (the HF tests
    skip there). The marker must leave it out on the floor and keep it from 3.11 on."""
    import pytest

    tomllib = _toml()
    requirements = pytest.importorskip("packaging.requirements")
    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    floor = project["requires-python"].removeprefix(">=")
    assert floor == "3.10", project["requires-python"]
    (hf,) = [r for r in map(requirements.Requirement, project["optional-dependencies"]["test"]) if r.name == "transformers"]
    assert hf.marker is not None, f"{hf}: transformers 5.21+ do not install on Python {floor}"
    assert not hf.marker.evaluate({"python_version": floor}) and hf.marker.evaluate({"python_version": "3.11"}), str(hf)
