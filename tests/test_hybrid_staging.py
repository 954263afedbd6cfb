"""Hybrid pools copy host arrays to the device as the plain pool does: through the pool's pinned
ring (``kvpool.staging``), one non-blocking copy per update, never a blocking ``.to(device)`` from
pageable memory (which waits for the device at every call).

No GPU is needed: a CPU pool is put on its device path (tables written by the kernel, not the
core, and a ring) with the ring replaced by a recorder, and its tables, caches and states are
compared with a CPU pool's after the same calls. That the real ring's copies overlap and never
wait is what a GPU run shows (benchmarks/gpu_check.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool import KVPool

W, P = 8, 4
TYPES = ["sliding_attention", "full_attention", "linear_attention", "sliding_attention"]
STATES = {"conv": (6, 4), "rec": ((2, 3), torch.float32)}


def make():
    return KVPool(4, 2, 8, layer_types=TYPES, sliding_window=W, state_shapes=STATES, dtype=torch.float32,
                  page_size=P, num_pages=64, max_requests=4, max_context_len=128)


class Ring:
    """Stands in for ``PinnedRing.to_device``: records what it copies (a fresh tensor each time,
    as the real ring's device copy is)."""

    def __init__(self) -> None:
        self.copies: list[np.ndarray] = []

    def __call__(self, host: np.ndarray) -> torch.Tensor:
        self.copies.append(np.array(host))
        return torch.from_numpy(np.array(host))


def on_device_path(pool, ring):
    """The pool as a CUDA pool runs it: tables written by the kernel, host data through ``ring``."""
    pool._tables_np = None
    pool._to_device = ring
    return pool


def fill(pool, res):
    for layer in (0, 1, 3):
        s = res.for_layer(layer)
        x = s.to(torch.float32).view(-1, 1, 1).expand(-1, 2, 8).contiguous() + 1000 * layer
        pool.write(layer, s, x, x)


def script(pool, device_to):
    """Calls that reach every host -> device copy of a hybrid pool: extend's slots and table
    writes, a window's released pages, fork's copy-on-write and state copies, a prefix hit's
    rows, truncate's restored state. ``device_to`` counts device copies made with ``.to``."""
    tokens = np.arange(10, 50, dtype=np.int64)
    h = pool.open(2)
    with device_to():
        res = pool.extend(h, [8, 9], tokens=np.concatenate([tokens[:8], tokens[20:29]]))
    fill(pool, res)
    s = pool.state_slots(h, 2)
    pool.state(2, "conv")[s] = torch.tensor([5.0, 6.0]).view(2, 1, 1)
    pool.cache(h[:1])
    with device_to():
        (f,) = pool.fork(int(h[0]), 1)
        res = pool.extend([f], 1)  # the shared partial page: copy-on-write
    fill(pool, res)
    with device_to():
        res = pool.extend(h, [12, 3], tokens=np.concatenate([tokens[8:20], tokens[29:32]]))  # window moves
    fill(pool, res)
    with device_to():
        g, cached = pool.open_with_prefix(np.concatenate([tokens[:8], [90, 91]]), [10])
        pool.truncate(h[:1], [8])
    assert cached[0] == 8  # a prefix hit: its rows were written from the core
    return np.concatenate([h, [f], g])


def snapshot(pool, handles):
    rows = pool.rows(handles)
    lengths = pool.lengths(handles)
    tables = [[pool.req_to_token[layer][r, :n].clone() for r, n in zip(rows, lengths)] for layer in (0, 1, 3)]
    return tables, [t.clone() for _, t in pool.named_tensors()]


@pytest.fixture
def device_to(monkeypatch):
    """A context that counts ``Tensor.to`` calls naming a device inside it."""
    import contextlib

    seen = {"inside": False, "calls": []}
    real = torch.Tensor.to

    def spy(self, *args, **kw):
        if seen["inside"] and ("device" in kw or any(isinstance(a, (str, torch.device)) for a in args)):
            seen["calls"].append((args, kw))
        return real(self, *args, **kw)

    monkeypatch.setattr(torch.Tensor, "to", spy)

    @contextlib.contextmanager
    def inside():
        seen["inside"] = True
        try:
            yield
        finally:
            seen["inside"] = False

    inside.calls = seen["calls"]
    return inside


def test_every_host_copy_goes_through_the_ring_and_matches_the_core(device_to):
    ring = Ring()
    dev = on_device_path(make(), ring)
    handles = script(dev, device_to)
    assert device_to.calls == [], "a hybrid pool copied to the device with .to(device), not its ring"
    assert ring.copies, "the device path made no copy through the ring"
    # One packed copy per update (as the plain pool's), not one per array.
    assert all(c.ndim == 1 and c.dtype == np.int64 for c in ring.copies)

    ref = make()
    ref_handles = script(ref, device_to)
    np.testing.assert_array_equal(dev.rows(handles), ref.rows(ref_handles))  # handles differ per pool
    (dev_tables, dev_tensors), (ref_tables, ref_tensors) = snapshot(dev, handles), snapshot(ref, ref_handles)
    for layer, a, b in zip((0, 1, 3), dev_tables, ref_tables):
        for row, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"layer {layer} request {row}: table differs from the core's"
    for (name, _), x, y in zip(dev.named_tensors(), dev_tensors, ref_tensors):
        assert torch.equal(x, y), f"{name} differs from the CPU pool's"
    dev.check()


def test_extend_results_come_from_one_ring_copy_and_are_normal_tensors(device_to):
    ring = Ring()
    pool = on_device_path(make(), ring)
    h = pool.open(2)
    before = len(ring.copies)
    with torch.inference_mode(), device_to():
        res = pool.extend(h, [3, 5])
    assert device_to.calls == []
    assert len(ring.copies) > before
    for layer in range(4):
        loc = res.for_layer(layer)
        assert not loc.is_inference(), "an engine may edit out_cache_loc in place outside inference mode"
        if pool.group(layer).kind != "state":
            np.testing.assert_array_equal(loc.numpy(), np.concatenate([pool.slots(int(x), layer)[-n:]
                                                                       for x, n in zip(h, [3, 5])]))
