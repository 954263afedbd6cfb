"""A hybrid pool's ``write`` and ``read`` on CUDA (kvpool/hybrid_rows.py), which no CPU pool runs.

- Host slots (a numpy array, ``step.slots``) are staged through the pool's pinned ring, as the
  plain pool's ``write`` stages them: kept on the host, index_copy_ / index_select refused them
  against CUDA caches with torch's untyped device-mismatch RuntimeError (a CPU pool took them).
- Padding (negative) slots cost no host sync: device slots are always "maybe negative", and
  dropping them with ``nonzero`` waited for the device at every layer's write of every step,
  and could not be captured. On CUDA padding goes to the group's reserved page 0, as the graph
  runner's padding does.

On CPU the pool is put on its device path (``_to_device`` set to a recording ring, as
tests/test_hybrid_staging.py does); the CUDA tests run the same calls on a GPU, with torch's
sync debug mode set to raise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvpool import KVPool

W, P, H, D = 8, 4, 2, 8
TYPES = ["sliding_attention", "full_attention", "linear_attention", "sliding_attention"]


def make(device="cpu"):
    return KVPool(4, H, D, layer_types=TYPES, sliding_window=W, state_shapes={"conv": (6, 4)},
                  dtype=torch.float32, page_size=P, num_pages=64, max_requests=4, max_context_len=128,
                  device=device)


class Ring:
    """Stands in for ``PinnedRing.to_device``: records the host arrays it copies."""

    def __init__(self) -> None:
        self.copies: list[np.ndarray] = []

    def __call__(self, host: np.ndarray) -> torch.Tensor:
        self.copies.append(np.array(host))
        return torch.from_numpy(np.array(host))


class Syncs(TorchFunctionMode):
    """Records the torch calls that wait for the device (on a CUDA tensor) made inside it."""

    NAMES = {"nonzero", "item", "tolist", "__bool__", "__int__", "unique", "masked_select"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def rows(n, layer, scale=1.0):
    x = torch.arange(n * H * D, dtype=torch.float32).view(n, H, D) * scale + 100 * layer
    return x, -x


def opened(pool):
    h = pool.open(2)
    return h, pool.extend(h, [5, 3])


@pytest.mark.parametrize("layer", [0, 1])
def test_host_slots_are_staged_through_the_ring(layer):
    want_pool, pool, ring = make(), make(), Ring()
    pool._to_device = ring  # what a CUDA pool runs
    for p in (want_pool, pool):
        _, step = opened(p)
    host = step.for_layer(layer).numpy().copy()
    k, v = rows(len(host), layer)
    before = len(ring.copies)
    pool.write(layer, host, k, v)
    assert len(ring.copies) == before + 1 and ring.copies[-1].tolist() == host.tolist()
    want_pool.write(layer, host, k, v)
    for a, b in zip(pool.read(layer, host), want_pool.read(layer, host)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(ring.copies) == before + 2  # read's host slots too
    torch.testing.assert_close(pool.read(layer, host)[0], k, rtol=0, atol=0)


def test_padding_is_stored_without_a_host_sync():
    pool, ring = make(), Ring()
    pool._to_device = ring
    _, step = opened(pool)
    slots = step.for_layer(1)
    padded = torch.cat([slots[:3], torch.tensor([-1, -1], dtype=slots.dtype), slots[3:]])
    k, v = rows(len(padded), 1)
    kb, vb = pool.k_buffer(1), pool.v_buffer(1)
    before = kb.clone(), vb.clone()
    with Syncs() as syncs:
        pool.write(1, padded, k, v)
    assert "nonzero" not in syncs.seen, f"a device pool's write synced: {syncs.seen}"
    real = padded >= 0
    torch.testing.assert_close(kb[padded[real].long()], k[real], rtol=0, atol=0)
    torch.testing.assert_close(vb[padded[real].long()], v[real], rtol=0, atol=0)
    # Nothing else changed but the group's reserved page 0 (padding's sink).
    untouched = torch.ones(kb.shape[0], dtype=torch.bool)
    untouched[padded[real].long()] = False
    untouched[:P] = False
    for now, was in zip((kb, vb), before):
        torch.testing.assert_close(now[untouched], was[untouched], rtol=0, atol=0)
    pool.check()


def test_a_cpu_pool_still_drops_padding_exactly():
    """The CPU pool (no ring) keeps its exact path: padding writes nothing, page 0 included."""
    pool = make()
    _, step = opened(pool)
    slots = step.for_layer(0)
    padded = torch.cat([torch.tensor([-1], dtype=slots.dtype), slots])
    k, v = rows(len(padded), 0)
    kb = pool.k_buffer(0)
    before = kb.clone()
    pool.write(0, padded, k, v)
    torch.testing.assert_close(kb[:P], before[:P], rtol=0, atol=0)
    torch.testing.assert_close(kb[slots.long()], k[1:], rtol=0, atol=0)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_cuda_write_and_read_take_host_slots():
    cpu, gpu = make(), make("cuda")
    for p in (cpu, gpu):
        _, step = opened(p)
    for layer in (0, 1, 3):
        host = step.for_layer(layer).cpu().numpy().copy()
        k, v = rows(len(host), layer)
        cpu.write(layer, host, k, v)
        gpu.write(layer, host, k.cuda(), v.cuda())
        for a, b in zip(gpu.read(layer, host), cpu.read(layer, host)):
            torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0)
    gpu.check()


@needs_cuda
def test_cuda_padded_device_slots_write_without_a_sync():
    pool = make("cuda")
    _, step = opened(pool)
    slots = step.for_layer(1)
    padded = torch.cat([slots[:3], torch.full((2,), -1, dtype=slots.dtype, device="cuda"), slots[3:]])
    k, v = rows(len(padded), 1)
    k, v = k.cuda(), v.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a nonzero (or any other wait for the device) raises
    try:
        pool.write(1, padded, k, v)
        got_k, _ = pool.read(1, padded)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    real = (padded >= 0).cpu()
    torch.testing.assert_close(got_k.cpu()[real], k.cpu()[real], rtol=0, atol=0)
    assert not got_k.cpu()[~real].any()
