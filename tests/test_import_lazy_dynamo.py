"""``import kvpool`` does not load ``torch._dynamo`` (about as long to import as torch itself),
and a pool built before Dynamo was loaded still runs its host checks eagerly under
``torch.compile`` (``kvpool._eager``). Fresh interpreters: this one has loaded Dynamo already."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kvpool

# Where this process imported kvpool from (the source tree with a built _core, or site-packages
# where CI installs it): the child imports the same one.
PYTHON_DIR = str(Path(kvpool.__file__).resolve().parents[1])


def _run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip()


def test_import_kvpool_leaves_dynamo_unloaded():
    # Before: kvpool.validate, rows and hybrid_rows made their torch.compiler.disable wrappers at
    # import, which imported torch._dynamo: 1.3 s of a 3 s `import kvpool` (torch 2.15, this VM),
    # paid by routers, metrics processes and pools that never compile.
    out = _run("import sys, torch\n"
               "before = 'torch._dynamo' in sys.modules\n"
               "import kvpool, kvpool.router, kvpool.events\n"
               "kvpool.KVPool(2, 2, 4, dtype=torch.float32, num_pages=16, max_requests=2, max_context_len=8)\n"
               "print(before, 'torch._dynamo' in sys.modules)")
    before, after = out.split()
    assert after == before, out  # (a torch that loads Dynamo itself is no fault of kvpool's)


def test_a_pool_built_before_dynamo_loads_writes_under_compile_as_eagerly():
    # Its wrappers are made at the first compiled call (kvpool._eager), with the same results.
    out = _run("import sys, torch, kvpool\n"
               "def pool():\n"
               "    return kvpool.KVPool(2, 2, 4, dtype=torch.float32, page_size=1, num_pages=32, max_requests=2,"
               " max_context_len=16)\n"
               "p, ref = pool(), pool()\n"
               "loaded = 'torch._dynamo' in sys.modules  # (False but where torch itself loads Dynamo)\n"
               "def step(pool, loc, k, v):\n"
               "    for layer in range(2):\n"
               "        pool.write(layer, loc, k * (layer + 1), v - layer)\n"
               "    a, b = pool.read(1, loc)\n"
               "    return a.sum() + b.sum()\n"
               "fn = torch.compile(step, backend='eager')\n"
               "h, hr = p.open(1), ref.open(1)\n"
               "for n in (3, 1, 2):\n"
               "    k, v = torch.randn(n, 2, 4), torch.randn(n, 2, 4)\n"
               "    with torch.inference_mode():\n"
               "        got, want = fn(p, p.extend(h, n).out_cache_loc, k, v), step(ref, ref.extend(hr, n).out_cache_loc, k, v)\n"
               "    assert torch.equal(got, want)\n"
               "for layer in range(2):\n"
               "    assert torch.equal(p.k_buffer(layer), ref.k_buffer(layer))\n"
               "    assert torch.equal(p.v_buffer(layer), ref.v_buffer(layer))\n"
               "import kvpool._eager\nfrom kvpool import rows\n"
               "print(loaded, not isinstance(rows._write_eager, kvpool._eager.EagerOnly))")
    assert out.split()[1] == "True", out


def test_pools_built_on_two_threads_at_once_both_build(monkeypatch):
    # Before: prepare() checked `while _PENDING` and then popped, so a pool built on another thread
    # that popped the last placeholder in between made this constructor raise an untyped IndexError
    # ("pop from empty list"). The interleaving is forced: the check sees one placeholder, which
    # the other thread's prepare() takes before the pop.
    import torch._dynamo  # noqa: F401 - prepare() makes the wrappers only once Dynamo is loaded

    import kvpool
    from kvpool import _eager

    made = []

    class OtherThreadPopsFirst(list):
        def __bool__(self) -> bool:
            nonempty = len(self) > 0
            if nonempty:
                made.append(self.pop())  # (the other thread's prepare)
            return nonempty

    space: dict = {}
    pending = OtherThreadPopsFirst()
    monkeypatch.setattr(_eager, "_PENDING", pending)
    _eager.EagerOnly(space, "f", len)
    kvpool.KVPool(2, 2, 4, dtype=torch.float32, num_pages=16, max_requests=2, max_context_len=8)
    assert not pending
    assert made or "f" in space  # (made by one of the two prepares)


def test_a_pool_built_before_torch_compile_loads_dynamo_is_compiled_once():
    # The usual order: build the pool, then torch.compile (which loads Dynamo). Before: the
    # placeholders were replaced by their wrappers inside the first trace, whose guard named the
    # placeholder, so the next call recompiled `write` and `read` (an error under
    # error_on_recompile or the "fail_on_recompile" stance, where wrappers made at import never
    # recompiled). The steady calls after a warm-up must not recompile.
    out = _run("import sys, torch, kvpool\n"
               "p = kvpool.KVPool(2, 2, 4, dtype=torch.float32, page_size=1, num_pages=32, max_requests=2,"
               " max_context_len=16)\n"
               "loaded = 'torch._dynamo' in sys.modules\n"
               "def step(pool, loc, k, v):\n"
               "    pool.write(0, loc, k, v)\n"
               "    a, b = pool.read(0, loc)\n"
               "    return a.sum() + b.sum()\n"
               "fn = torch.compile(step, backend='eager')\n"
               "h = p.open(1)\n"
               "k, v = torch.randn(1, 2, 4), torch.randn(1, 2, 4)\n"
               "with torch.inference_mode():\n"
               "    fn(p, p.extend(h, 1).out_cache_loc, k, v)\n"
               "    torch._dynamo.config.error_on_recompile = True\n"
               "    for _ in range(3):\n"
               "        got = fn(p, p.extend(h, 1).out_cache_loc, k, v)\n"
               "        assert torch.equal(got, k.sum() + v.sum()), got\n"
               "print(loaded, 'ok')")
    assert out.split()[-1] == "ok", out
