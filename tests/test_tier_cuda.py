"""The host tier on a real GPU: pinned HostStorage, bitwise page round trips through the
Triton kernel (pinned memory read and written through its device-mapped address) and
through batched copies, and the TransferRunner's stream protocol with real streams and
events. Skipped without CUDA (the same behaviour is covered on CPU and through the
Triton interpreter by test_tier_pages.py and test_tier_transfers.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
from kvpool.errors import TensorDeviceError
from kvpool.kernels import load_pages, offload_pages
from kvpool.tiers import HostStorage, TransferRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

P = 16
LAYERS = 4


def bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


# Not named setup: pytest 7 calls a module-level setup() as a nose-style fixture, with the module.
def pool_and_host(dtype=torch.bfloat16, mla=False, seed=0):
    if mla:
        pool = kvpool.KVPool(LAYERS, 1, 576, kv_lora_rank=512, qk_rope_head_dim=64, dtype=dtype, page_size=P,
                             num_pages=16, device="cuda", max_requests=4, max_context_len=256)
    else:
        pool = kvpool.KVPool(LAYERS, 8, 128, dtype=dtype, page_size=P, num_pages=16, device="cuda",
                             max_requests=4, max_context_len=256)
    host = HostStorage.for_pool(pool, host_pages=8)
    gen = torch.Generator().manual_seed(seed)
    for t in pool._storage.caches:
        bits(t).copy_(torch.randint(0, 256, (bits(t).numel(),), dtype=torch.uint8, generator=gen).cuda())
    bits(host.buffer).copy_(torch.randint(0, 256, (bits(host.buffer).numel(),), dtype=torch.uint8, generator=gen))
    return pool, host


def dev_page(pool, page):
    return torch.stack([c[:, page * P : (page + 1) * P] for c in pool._storage.caches]).cpu()


def test_host_storage_is_pinned_and_normal():
    with torch.inference_mode():
        pool, host = pool_and_host()
    assert host.pinned and host.buffer.is_pinned() and not host.buffer.is_inference()


@pytest.mark.parametrize("method", ["kernel", "copy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("mla", [False, True], ids=["kv", "mla"])
def test_round_trip_is_bitwise(method, dtype, mla):
    pool, host = pool_and_host(dtype, mla)
    before = {p: dev_page(pool, p) for p in range(pool.num_pages)}
    offload_pages(pool._storage.caches, host, [2, 9, 5], [3, 1, 7], method=method)
    torch.cuda.synchronize()
    for d, h in ((2, 3), (9, 1), (5, 7)):
        assert torch.equal(bits(host.buffer[h]), bits(before[d])), (d, h)
    load_pages(host, pool._storage.caches, [3, 1, 7], [11, 4, 15], method=method)
    torch.cuda.synchronize()
    for p in range(pool.num_pages):
        want = {11: before[2], 4: before[9], 15: before[5]}.get(p, before[p])
        assert torch.equal(bits(dev_page(pool, p)), bits(want)), p


def test_pageable_host_memory_is_refused():
    pool, host = pool_and_host()
    pageable = host.buffer.clone()
    assert not pageable.is_pinned()
    with pytest.raises(TensorDeviceError, match="pinned"):
        offload_pages(pool._storage.caches, pageable, [1], [1])
    with pytest.raises(TensorDeviceError, match="host integers"):
        offload_pages(pool._storage.caches, host, torch.tensor([1], device="cuda"), [1])


def test_the_copy_stream_waits_for_the_callers_writes():
    """K/V written on the caller's stream behind a long kernel must be what the offload reads."""
    pool, host = pool_and_host()
    runner = TransferRunner.for_pool(pool, host)
    k = torch.randn(P, 8, 128, device="cuda").bfloat16()
    torch.cuda._sleep(50_000_000)  # keeps the caller's stream busy
    pool.write(0, torch.arange(3 * P, 4 * P, device="cuda"), k, k)
    runner.run(offloads=(np.array([3]), np.array([2])))
    runner.synchronize()
    assert torch.equal(bits(host.buffer[2, 0, 0]), bits(k.cpu()))


def test_the_callers_stream_waits_for_the_loads():
    """A read queued on the caller's stream right after run() sees the loaded page even when
    the copy stream is held back."""
    pool, host = pool_and_host()
    runner = TransferRunner.for_pool(pool, host)
    with torch.cuda.stream(runner.copy_stream):
        torch.cuda._sleep(50_000_000)
    runner.run(loads=(np.array([5]), np.array([6])))
    k, _ = pool.read(1, torch.arange(6 * P, 7 * P, device="cuda"))
    assert torch.equal(bits(k.cpu()), bits(host.buffer[5, 0, 1]))


@pytest.mark.parametrize("method", ["kernel", "copy"])
def test_layered_loads_with_per_layer_waits(method):
    pool, host = pool_and_host()
    runner = TransferRunner.for_pool(pool, host, method=method)
    old = dev_page(pool, 2)
    batch = runner.run(offloads=(np.array([2]), np.array([1])), loads=(np.array([4]), np.array([2])),
                       copies=(np.arange(2 * P, 3 * P), np.arange(7 * P, 8 * P)), layered=True)
    assert len(batch.layer_events) == LAYERS
    for layer in range(LAYERS):
        batch.wait_layer(layer)
        k, v = pool.read(layer, torch.arange(7 * P, 8 * P, device="cuda"))
        assert torch.equal(bits(k.cpu()), bits(host.buffer[4, 0, layer]))
        assert torch.equal(bits(v.cpu()), bits(host.buffer[4, 1, layer]))
    batch.synchronize()
    assert torch.equal(bits(host.buffer[1]), bits(old))
