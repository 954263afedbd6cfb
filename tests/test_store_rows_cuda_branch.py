"""``store_kv``'s CUDA branch (kvpool/kernels/ops.py ``store_rows``), run on CPU: rows that are views
of the caches (a caller moving rows within a layer) are copied out before the kernel reads them.

That copy was made on the CPU only. On a GPU the store kernel's programs run in parallel, so a
program could read a row another program had already overwritten: rows shifted up by one slot
came back as the first row repeated, or not, depending on scheduling. Here the caches are a
tensor subclass that reports ``is_cuda``, and the Triton launch is replaced by one that stores
row after row (the order that shows the overwrite, as Triton's interpreter did); the GPU test
runs the real kernel.
"""

from __future__ import annotations

import pytest
import torch

import kvpool.kernels as K
import kvpool.kernels.store as store_mod
from kvpool.kernels import _common as c


class CudaLooking(torch.Tensor):
    """A CPU tensor that store_rows takes for a CUDA one (its branch choice reads ``is_cuda``)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def in_order_launch(reads):
    def launch(k_cache, v_cache, slots, k, v, kg, vg, has_v, k_scale, v_scale):
        reads.append((k, v))
        for i, s in enumerate(slots.tolist()):  # program i after program i - 1
            k_cache[s] = k[i]
            if has_v:
                v_cache[s] = v[i]

    return launch


def test_rows_that_view_the_cache_are_copied_out_on_the_cuda_branch(monkeypatch):
    reads = []
    monkeypatch.setattr(store_mod, "launch_store_kv", in_order_launch(reads))
    monkeypatch.setattr(c, "use_triton", lambda t: True)  # (Triton on CUDA; none is needed here)
    flat = torch.arange(8 * 4, dtype=torch.float32).view(8, 1, 4)
    kc, vc = flat.clone().as_subclass(CudaLooking), (-flat).as_subclass(CudaLooking)
    assert kc.is_cuda
    want_k, want_v = kc.clone(), vc.clone()
    want_k[1:4], want_v[1:4] = kc[0:3].clone(), vc[0:3].clone()
    K.store_kv(kc, vc, torch.tensor([1, 2, 3]), kc[0:3], vc[0:3])
    assert len(reads) == 1, "the store did not take the kernel branch"
    assert not c.views_of((kc, vc), reads[0][0]) and not c.views_of((kc, vc), reads[0][1])
    assert torch.equal(kc.as_subclass(torch.Tensor), want_k.as_subclass(torch.Tensor))
    assert torch.equal(vc.as_subclass(torch.Tensor), want_v.as_subclass(torch.Tensor))


def test_rows_apart_from_the_cache_are_not_copied(monkeypatch):
    """The copy is made only for rows that share the caches' memory: a step's new rows go to
    the kernel as they are."""
    reads = []
    monkeypatch.setattr(store_mod, "launch_store_kv", in_order_launch(reads))
    monkeypatch.setattr(c, "use_triton", lambda t: True)
    kc = torch.zeros(8, 1, 4).as_subclass(CudaLooking)
    vc = torch.zeros(8, 1, 4).as_subclass(CudaLooking)
    k, v = torch.ones(2, 1, 4), -torch.ones(2, 1, 4)
    K.store_kv(kc, vc, torch.tensor([5, 6]), k, v)
    assert reads[0][0] is k and reads[0][1] is v


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n", [3, 257])
def test_cuda_rows_shifted_within_a_layer_are_stored_as_at_the_call(n):
    flat = torch.arange((n + 1) * 2 * 64, dtype=torch.float32, device="cuda").view(n + 1, 2, 64).to(torch.float16)
    kc, vc = flat.clone(), -flat
    want_k, want_v = kc.clone(), vc.clone()
    want_k[1:], want_v[1:] = kc[:n].clone(), vc[:n].clone()
    K.store_kv(kc, vc, torch.arange(1, n + 1, device="cuda"), kc[:n], vc[:n])
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
