"""pool.write with host (CPU) slots inside CUDA graph capture is rejected with a clear
error (its host -> device copy cannot be captured); outside capture host slots stay
welcome. Capture is mocked (validate._capturing), so the check runs on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool import validate
from kvpool.errors import TensorDeviceError

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def capturing(monkeypatch):
    state = {"on": False}
    monkeypatch.setattr(validate, "_capturing", lambda device: state["on"])
    return state


@pytest.mark.parametrize("slots", [np.array([16, 17]), [16, 17], torch.tensor([16, 17])],
                         ids=["numpy", "list", "cpu-tensor"])
def test_host_slots_rejected_while_capturing(capturing, slots):
    capturing["on"] = True
    with pytest.raises(TensorDeviceError, match="captured") as e:
        validate.slots_tensor(slots, CUDA0, 1024, 16, strict=False)
    assert "out_cache_loc" in str(e.value)  # says what to pass instead


def test_host_slots_accepted_for_a_cuda_pool_outside_capture(capturing):
    t, neg = validate.slots_tensor(np.array([16, -1]), CUDA0, 1024, 16, strict=False)
    assert t.tolist() == [16, -1] and neg


def test_cpu_pool_never_asks_about_capture(monkeypatch):
    def boom(device):
        raise AssertionError("capture state checked for a CPU pool")

    monkeypatch.setattr(validate, "_capturing", boom)
    t, _ = validate.slots_tensor([16], torch.device("cpu"), 1024, 16, strict=False)
    assert t.tolist() == [16]


def test_pool_write_rejects_host_slots_and_writes_nothing(capturing, monkeypatch):
    """Through KVPool.write: a CPU pool pretending to be on cuda:0 for the check only."""
    import kvpool

    pool = kvpool.KVPool(1, 2, 8, num_pages=8, page_size=4, max_requests=2, max_context_len=8)
    before = [t.clone() for t in pool.k_buffers + pool.v_buffers]
    real = validate.slots_tensor
    monkeypatch.setattr("kvpool.rows.slots_tensor", lambda s, d, *a, **k: real(s, CUDA0, *a, **k))
    capturing["on"] = True
    k = torch.ones((2, 2, 8), dtype=torch.float16)
    with pytest.raises(TensorDeviceError, match="captured"):
        pool.write(0, np.array([4, 5]), k, k)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k_buffers + pool.v_buffers))
