"""The grad-mode matrix: a pool built in any mode works when used in any mode.

Built under {default, no_grad, inference_mode, a worker thread (itself in
inference_mode)} x used under {default, no_grad, inference_mode, a
torch.compile'd function writing through the pool, another thread}. Every cell
runs the same operations (open, extend, write, read the views, a decode step,
close, reset) and checks: no pool tensor is an inference tensor or requires
grad, the caller's modes are untouched, writes land in exactly the right slots
(compared with a dense reference), and req_to_token matches the allocator.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kvpool

H, D, LAYERS, SLOTS, PAGE = 2, 4, 2, 64, 2
BUILD_MODES = ["default", "no_grad", "inference_mode", "worker_thread"]
USE_MODES = ["default", "no_grad", "inference_mode", "compile", "other_thread"]


def in_thread(fn: Callable[[], Any]) -> Any:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def build(mode: str) -> kvpool.KVPool:
    def make() -> kvpool.KVPool:
        return kvpool.KVPool(
            LAYERS, H, D, dtype=torch.float32, page_size=PAGE, num_slots=SLOTS, max_requests=4, max_context_len=16
        )

    if mode == "worker_thread":
        # Engine worker threads typically run under inference_mode themselves.
        def worker() -> kvpool.KVPool:
            with torch.inference_mode():
                return make()

        return in_thread(worker)
    ctx: dict[str, Any] = {"default": contextlib.nullcontext(), "no_grad": torch.no_grad(), "inference_mode": torch.inference_mode()}
    with ctx[mode]:
        return make()


def _write_through_pool(pool: kvpool.KVPool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    pool.write(layer, slots, k * 1.0, v * 1.0)
    return pool.k_buffer(layer)[slots].sum()


_compiled: Callable[..., Any] | None = None


def compiled_write() -> Callable[..., Any]:
    # One compiled function for the whole matrix (compiling once, ~5-20 s on
    # this CPU with inductor; later pools hit the same graph or recompile fast).
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_write_through_pool, backend="inductor")
    return _compiled


class Reference:
    """Dense expected contents of every layer's K and V caches."""

    def __init__(self) -> None:
        self.k = torch.zeros(LAYERS, SLOTS, H, D)
        self.v = torch.zeros(LAYERS, SLOTS, H, D)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer, slots.long()] = k.detach()
        self.v[layer, slots.long()] = v.detach()


def rows_for(n: int, seed: int, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
    if grad:
        # Model outputs in grad mode require grad; the cache must not catch it.
        w = torch.ones((), requires_grad=True)
        k, v = k * w, v * w
    return k, v


def operate(pool: kvpool.KVPool, use: str, ref: Reference) -> None:
    """The operations of one cell, run in the current thread's modes."""
    modes_before = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    write = compiled_write() if use == "compile" else _write_through_pool
    grad = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()

    handles = pool.open(3)
    res = pool.extend(handles, [5, 1, 3])
    assert res.out_cache_loc.dtype == torch.int64 and res.out_cache_loc.tolist() == res.slots.tolist()
    for layer in range(LAYERS):
        k, v = rows_for(len(res.slots), seed=layer, grad=grad)
        write(pool, layer, res.out_cache_loc, k, v)
        ref.write(layer, res.out_cache_loc, k, v)
        # Views read in this mode see the data (paged view of the same memory too).
        assert torch.equal(pool.k_buffer(layer)[res.out_cache_loc], k.detach())
    # A decode step: one more token each, padded to a batch of 4 with a -1 slot.
    step = pool.extend(handles, 1)
    slots = torch.cat([step.out_cache_loc, torch.tensor([-1])])
    for layer in range(LAYERS):
        k, v = rows_for(4, seed=10 + layer, grad=grad)
        write(pool, layer, slots, k, v)
        ref.write(layer, step.out_cache_loc, k[:3], v[:3])
    for h in handles:
        n = pool.allocator.length(h)
        assert pool.req_to_token[pool.allocator.rows(h)[0], :n].tolist() == pool.allocator.slots(h).tolist()
    pool.close(handles[1])
    assert (torch.is_grad_enabled(), torch.is_inference_mode_enabled()) == modes_before


def check_pool(pool: kvpool.KVPool, ref: Reference) -> None:
    for name, t in pool.named_tensors():
        assert not t.is_inference(), name
        assert not t.requires_grad, name
    for layer in range(LAYERS):
        for view in (pool.k_buffer(layer), pool.v_buffer(layer)):
            assert not view.is_inference() and not view.requires_grad
        assert torch.equal(pool.k_buffer(layer), ref.k[layer])
        assert torch.equal(pool.v_buffer(layer), ref.v[layer])
    assert not pool.req_to_token[pool.null_row].any()
    pool.allocator.check()


@pytest.mark.parametrize("use", USE_MODES)
@pytest.mark.parametrize("built", BUILD_MODES)
def test_matrix(built: str, use: str) -> None:
    pool = build(built)
    ref = Reference()
    if use == "other_thread":
        # The caller sits in inference_mode; the worker thread starts in neither.
        with torch.inference_mode():
            in_thread(lambda: operate(pool, use, ref))
    elif use == "no_grad":
        with torch.no_grad():
            operate(pool, use, ref)
    elif use == "inference_mode":
        with torch.inference_mode():
            operate(pool, use, ref)
    else:
        operate(pool, use, ref)
    check_pool(pool, ref)
    pool.reset()
    assert pool.allocator.open_requests == 0 and pool.allocator.used_pages == 0
    # After the cell, the pool is still writable in plain grad mode, eagerly.
    h = pool.open(1)
    res = pool.extend(h, 2)
    pool.write(0, res.slots, torch.ones(2, H, D), torch.ones(2, H, D))
    assert torch.equal(pool.k_buffer(0)[res.out_cache_loc], torch.ones(2, H, D))


def test_matrix_paged_layout_shares_memory_with_token_layout() -> None:
    # One extra cell on the paged layout: its views are the same bytes.
    with torch.inference_mode():
        pool = kvpool.KVPool(1, H, D, dtype=torch.float32, page_size=4, num_pages=8, layout="paged",
                             max_requests=2, max_context_len=16)
    assert pool.k_buffer(0).shape == (8, 4, H, D)
    h = pool.open(1)
    with torch.no_grad():
        res = pool.extend(h, 6)
        k = torch.randn(6, H, D)
        pool.write(0, res.out_cache_loc, k, -k)
    paged = pool.k_buffer(0)
    for i, s in enumerate(res.slots.tolist()):
        assert torch.equal(paged[s // 4, s % 4], k[i])
        assert torch.equal(pool.v_buffer(0)[s // 4, s % 4], -k[i])
    assert not paged.is_inference()
