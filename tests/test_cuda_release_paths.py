"""On a real GPU, what tests/test_tier_host_storage.py, test_hf_cache_spare_streams.py and
test_hybrid_staging.py check on CPU with torch.cuda faked: a refused cudaHostRegister leaves no
error for torch's next launch check, a pinned HostStorage dropped inside a graph capture neither
syncs nor breaks the capture, a hybrid pool's host copies go through its pinned ring, and (two
GPUs) a capture is asked of the tensor's device. Skipped without CUDA."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from kvpool import KVPool
from kvpool.tiers import HostStorage
from kvpool.tiers import host_storage as hs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def storage():
    return HostStorage(3, num_layers=2, page_size=4, heads=2, head_dim=8, dtype=torch.bfloat16, device="cuda")


def test_a_refused_registration_leaves_no_error_for_the_next_launch():
    t = torch.empty(1 << 20, dtype=torch.uint8)
    assert hs._cudart_lib() is not None, "torch's libcudart was not found: nothing would be registered"
    assert hs._register(t)
    try:
        assert not hs._register(t)  # already registered: refused (cudaErrorHostMemoryAlreadyRegistered)
        x = torch.ones(4, device="cuda") * 2  # torch reads cudaGetLastError after this launch
        torch.cuda.synchronize()
        assert x.sum().item() == 8
    finally:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def test_a_pinned_storage_dropped_inside_a_capture_is_released_after_it():
    host = storage()
    assert host.pinned
    deferred = len(hs._deferred)
    x = torch.zeros(8, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.add_(1)
        del host
        gc.collect()  # the release comes due here: a device sync would invalidate the capture
        x.add_(1)
    assert len(hs._deferred) == deferred + 1
    g.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 8
    other = storage()  # a safe point: the deferred release runs
    assert other.pinned and hs._deferred == []


def test_a_hybrid_pool_stages_its_host_copies_through_its_ring():
    types = ["sliding_attention", "full_attention", "linear_attention", "sliding_attention"]
    pool = KVPool(4, 2, 8, layer_types=types, sliding_window=8, state_shapes={"conv": (6, 4)},
                  dtype=torch.bfloat16, page_size=4, num_pages=64, max_requests=4, max_context_len=128,
                  device="cuda")
    ring = pool._to_device.__self__
    h = pool.open(2)
    res = pool.extend(h, [3, 13])
    assert ring.depth >= 1
    torch.cuda.synchronize()
    rows = pool.rows(h)
    for layer in (0, 1, 3):
        want = np.concatenate([pool.slots(int(x), layer)[-n:] for x, n in zip(h, [3, 13])])
        np.testing.assert_array_equal(res.for_layer(layer).cpu().numpy(), want)
        for r, x in zip(rows, h):
            n = pool.length(int(x))
            table = pool.req_to_token[layer][int(r), :n].cpu().numpy()
            held = pool.slots(int(x), layer)
            np.testing.assert_array_equal(table[n - len(held):], held)
    pool.check()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_capture_is_asked_of_the_tensors_device():
    from kvpool.integrations._layer_buffers import reusable, stream_mark

    t = torch.zeros(4, device="cuda:1")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.device(1), torch.cuda.graph(g):
        t.add_(1)
        with torch.cuda.device(0):  # cuda:0 current, not capturing; cuda:1 is
            assert not reusable(t) and stream_mark(t) is None
    with torch.cuda.device(1):
        assert reusable(t)
