"""The pool's device path through kvpool.kernels, checked on CPU.

A CUDA pool updates ``req_to_token`` with ``extend_packed`` + one copy +
``kernels.write_req_to_token``. Here a CPU pool is switched onto that path
("wired") and compared with a plain CPU pool (the core writes its table) fed the
same operations. In-process both pools' writes run the kernels' torch backend
(this checks argument order, dtypes, offsets, scales, padding); the last test
reruns this file in a subprocess with ``TRITON_INTERPRET=1``, where the wired
pool runs the real Triton kernels through the interpreter and the plain pool
stays on the torch backend.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import kvpool
from kvpool import kernels
from kvpool.kernels import _common

H, D = 2, 8
CONFIGS = {
    "token-f16": dict(dtype=torch.float16, layout="token", page_size=1),
    "paged-f32": dict(dtype=torch.float32, layout="paged", page_size=4),
    "fp8": dict(dtype=torch.float8_e4m3fn, layout="token", page_size=4, compute_dtype=torch.float16),
    "mla": dict(dtype=torch.float16, layout="paged", page_size=4, kv_lora_rank=6, qk_rope_head_dim=2),
}


def pair(cfg: dict[str, Any]) -> tuple[kvpool.KVPool, kvpool.KVPool]:
    heads, dim = (1, 8) if "kv_lora_rank" in cfg else (H, D)

    def make() -> kvpool.KVPool:
        return kvpool.KVPool(2, heads, dim, num_pages=64 // cfg["page_size"] + 1, max_requests=4, max_context_len=32, **cfg)

    plain, wired = make(), make()
    wired._table_np = None  # take the device branch of extend()
    return plain, wired


@contextlib.contextmanager
def backend(pool: kvpool.KVPool, wired: kvpool.KVPool) -> Iterator[None]:
    """The plain pool always runs the kernels' torch backend (they read INTERPRET per call)."""
    old = _common.INTERPRET
    _common.INTERPRET = old and pool is wired
    try:
        yield
    finally:
        _common.INTERPRET = old


def test_interpreter_flag_matches_env() -> None:
    assert kernels.INTERPRET == (os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kernel_hooks_match_the_torch_path(name: str) -> None:
    plain, wired = pair(CONFIGS[name])
    for pool in (plain, wired):
        if pool.k_scale is not None:
            pool.k_scale.copy_(torch.tensor([0.5, 2.0]))
        if pool.v_scale is not None and pool.v_scale is not pool.k_scale:
            pool.v_scale.copy_(torch.tensor([4.0, 0.25]))
    rng = np.random.default_rng(0)
    handles = [p.open(3) for p in (plain, wired)]
    # Each allocator draws its own generation base: same rows, different handles.
    assert (plain.rows(handles[0]) == wired.rows(handles[1])).all()
    for _step, counts in enumerate(([5, 1, 9], [1, 1, 1], [0, 4, 1])):
        results = []
        for p, h in zip((plain, wired), handles):
            with backend(p, wired):
                results.append(p.extend(h, counts))
        assert results[0].slots.tolist() == results[1].slots.tolist()
        assert torch.equal(results[0].out_cache_loc, results[1].out_cache_loc)
        n = len(results[0].slots)
        slots = torch.tensor(results[0].slots.tolist() + [-1])  # one padding row
        for layer in range(2):
            k = torch.from_numpy(rng.standard_normal((n + 1, plain.num_kv_heads, plain.head_dim)))
            k = (k * 3).to(plain.compute_dtype)
            v = None if plain.mla else -k
            for p in (plain, wired):
                with backend(p, wired):
                    p.write(layer, slots, k, v)
    assert torch.equal(plain.req_to_token, wired.req_to_token)
    for (name_a, a), (name_b, b) in zip(plain.named_tensors(), wired.named_tensors()):
        assert name_a == name_b
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name_a
    for layer in range(2):
        got = []
        for p in (plain, wired):
            with backend(p, wired):
                got.append(p.read(layer, results[0].slots))
        for x, y in zip(*got):
            assert torch.equal(x, y)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="already interpreted")
def test_through_triton_interpreter() -> None:
    # TRITON_INTERPRET is read when the kernel modules are imported, hence a
    # fresh interpreter. fp8/bf16 arithmetic is unsupported by the Triton
    # interpreter on CPU, so only the f16/f32/MLA configs run there.
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
           "-k", "interpreter_flag or (kernel_hooks and not fp8)"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " 4 passed" in out.stdout or "4 passed" in out.stdout, out.stdout[-1000:]
