"""What kvpool needs to run on the dependency floors pyproject.toml declares (torch 2.4 with
Triton 3.0, numpy 1.24), checked on whatever versions are installed.

Run on the floor itself (a venv with torch==2.4.1, triton==3.0.0, numpy==1.24.4), these cases
failed before their fixes; on today's versions the Triton one still fails if a kernel module
goes back to string annotations, the fp8 one only checks the pool's contents.
"""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys

import pytest
import torch

import kvpool
from kvpool.torch_types import FP8_DTYPES

KERNEL_MODULES = ["copy", "gather", "page_copy", "req_table", "store"]


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_kernel_constexpr_parameters_are_annotated_with_the_class(name: str) -> None:
    """Triton 3.0's interpreter (TRITON_INTERPRET=1, how the CPU tests run the kernels) treats a
    parameter as constexpr only when ``__annotations__`` holds the ``tl.constexpr`` class: under
    ``from __future__ import annotations`` it holds the string "tl.constexpr", the interpreter
    passed ROWS / BLOCK_D as tensors and every launch failed ("arange's arguments must be of
    type tl.constexpr"). Triton 3.1+ accepts either, so only this check fails on them."""
    triton = pytest.importorskip("triton", reason="the kernels need Triton")
    tl = importlib.import_module("triton.language")
    module = importlib.import_module(f"kvpool.kernels.{name}")
    kernels = [v for v in vars(module).values() if isinstance(v, triton.runtime.JITFunction)]
    assert kernels, f"kvpool.kernels.{name} defines no @triton.jit function"
    for kernel in kernels:
        annotations = inspect.getfullargspec(kernel.fn).annotations
        named_constexpr = {p: a for p, a in annotations.items() if "constexpr" in str(a)}
        strings = {p: a for p, a in named_constexpr.items() if a is not tl.constexpr}
        assert not strings, f"{name}.{kernel.fn.__name__}: constexpr parameters annotated {strings}, not tl.constexpr"


@pytest.mark.parametrize("layout", ["paged", "token"])
@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
def test_an_fp8_pool_on_cpu_starts_zeroed_and_round_trips(layout: str, dtype: torch.dtype) -> None:
    """torch 2.4 has no CPU fill for fp8: ``torch.zeros`` of the caches raised an untyped
    RuntimeError ("fill_cpu" not implemented for 'Float8_e4m3fn') from ``KVPool(dtype=fp8)``.
    The caches are made as zeroed bytes: +0.0 everywhere, as before."""
    pool = kvpool.KVPool(2, 2, 4, dtype=dtype, num_pages=64, page_size=4, max_requests=2,
                         max_context_len=32, layout=layout)
    assert all(c.dtype == dtype and not c.view(torch.uint8).any() for c in pool._storage.caches)
    handles = pool.open(1)
    slots = pool.extend(handles, [6]).slots
    k = torch.linspace(-4, 4, 6 * 2 * 4).reshape(6, 2, 4).to(pool.compute_dtype)
    pool.write(1, slots, k, -k)
    gk, gv = pool.read(1, slots)
    assert torch.equal(gk, k.to(dtype).to(pool.compute_dtype)) and torch.equal(gv, (-k).to(dtype).to(pool.compute_dtype))


@pytest.mark.parametrize("patch,message", [
    ("transformers.__version__ = '5.22.2'", r"API of 5\.23 on; found transformers 5\.22\.2: .*transformers>=5\.23,<6"),
    ("transformers.__version__ = '6.0.0'", r"found transformers 6\.0\.0"),
    ("import transformers.utils as u; u.is_torch_available = lambda: False", r"does not run on torch .*torch>=2\.6"),
    # Python 3.10 gets transformers 5.20 at most (5.21+ need 3.11): 'pip install kvpool[hf]' cannot
    # help there, and the message says why. (version_info is set after the imports that might read it.)
    ("import transformers.cache_utils, transformers.utils, torch, kvpool\n"
     "sys.version_info = (3, 10, 13, 'final', 0); transformers.__version__ = '5.20.2'",
     r"found transformers 5\.20\.2: .*transformers 5\.21\+ need Python 3\.11\+; this is Python 3\.10"),
], ids=["5.22", "6.0", "torch-disabled", "python-3.10"])
def test_the_transformers_integration_refuses_what_it_cannot_run_on(patch: str, message: str) -> None:
    """transformers 5.0-5.22 lack the cache-layer API KVPoolCache implements (an ImportError from
    _hybrid before 5.15, an AttributeError on Cache.is_dummy at the first cache before 5.23), and
    5.20+ switch their torch support off below torch 2.6 (models become placeholders): the
    import says so, with what to install. A fresh interpreter, as the check runs at import."""
    pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
    code = f"import sys, transformers\n{patch}\nimport kvpool.integrations.transformers\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "ImportError" in r.stderr, r.stderr[-2000:]
    assert re.search(message, r.stderr.strip().splitlines()[-1]), r.stderr[-2000:]
