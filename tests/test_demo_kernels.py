"""The demo on the pool's device path (the one --device cuda takes), checked on CPU.

A CUDA pool updates req_to_token through ``extend_packed`` and
``kernels.write_req_to_token`` (a CPU pool's core writes its table itself), and
every pool stores K/V through ``kernels.store_kv``. Here a CPU pool is switched
onto the device table path (as tests/test_pool_kernels.py does) and the demo engine must still produce exactly
the cache-free logits. In-process the kernel wrappers run their CPU path; the
second test reruns this file as a script with ``TRITON_INTERPRET=1`` so the real
Triton kernels run (through the interpreter) under the engine.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import kvpool
from kvpool.demo.engine import Engine
from kvpool.demo.model import ModelConfig, build_model
from kvpool.demo.requests import synthetic_requests

CFG = ModelConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, max_positions=32, seed=7)


def run_engine_on_kernel_path(page_size: int) -> int:
    model = build_model(CFG)
    pool = kvpool.KVPool(CFG.layers, CFG.kv_heads, CFG.head_dim, dtype=torch.float32,
                         page_size=page_size, num_pages=48 // page_size + 1, max_requests=4,
                         max_context_len=32)
    pool._table_np = None  # take extend()'s device branch
    reqs = synthetic_requests(6, vocab_size=CFG.vocab_size, prompt_len=(2, 12), output_len=(2, 10),
                              seed=2)
    engine = Engine(model, pool, max_running=4, record=True)
    with torch.inference_mode():
        stats = engine.run(reqs)
        for r in reqs:
            ref = model.forward_full(r.all_tokens())
            torch.testing.assert_close(torch.cat(r.logits), ref, atol=1e-5, rtol=1e-4)
    assert stats.requests_done == len(reqs) and pool.used_pages == 0
    return stats.requests_done


def test_demo_on_kernel_path_matches_full_forward():
    for page_size in (1, 16):
        assert run_engine_on_kernel_path(page_size) == 6


def test_demo_on_triton_interpreted_kernels():
    # TRITON_INTERPRET is read when the kernel modules are imported: a fresh process.
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "interpreted kernels: ok" in out.stdout, out.stdout[-1000:]


if __name__ == "__main__":
    from kvpool import kernels

    assert kernels.INTERPRET, "run with TRITON_INTERPRET=1"
    for size in (1, 16):
        run_engine_on_kernel_path(size)
    print("interpreted kernels: ok")
