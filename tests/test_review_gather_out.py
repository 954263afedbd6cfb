"""Outside-style sweep: ``gather_kv(out=...)`` into memory that overlaps the caches it reads,
or K and V into one tensor. The backends disagreed (torch reads every row before it writes
any, the kernel row by row: under the interpreter a K row gathered into the V cache was read
back as V; on a GPU, a race); both refuse it now, before anything is written. The check reads
metadata only, so it runs the same on every backend."""

from __future__ import annotations

import pytest
import torch

import kvpool.kernels as K


def caches(dtype=torch.float16):
    k = torch.arange(16, dtype=torch.float32).view(16, 1, 1).expand(16, 2, 4).to(dtype)
    return k.contiguous(), (-k).contiguous()


def outs_overlapping(kc, vc):
    buf = torch.zeros(3, 2, 4, dtype=kc.dtype)
    return {
        "k_out in k_cache": (kc[4:7], torch.zeros_like(buf)),
        "k_out in v_cache": (vc[4:7], torch.zeros_like(buf)),
        "v_out in k_cache": (torch.zeros_like(buf), kc[4:7]),
        "swapped": (vc[4:7], kc[4:7]),
        "k_out is v_out": (buf, buf),
        "k_out and v_out overlap": (lambda b: (b[0:3], b[1:4]))(torch.zeros(4, 2, 4, dtype=kc.dtype)),
    }


@pytest.mark.parametrize("case", list(outs_overlapping(*caches())))
@pytest.mark.parametrize("paged", [False, True], ids=["token", "paged"])
def test_gather_kv_refuses_outputs_overlapping_caches_or_each_other(case, paged):
    kc, vc = caches()
    out = outs_overlapping(kc, vc)[case]
    k_cache, v_cache = (kc.view(4, 4, 2, 4), vc.view(4, 4, 2, 4)) if paged else (kc, vc)
    before = kc.clone(), vc.clone(), out[0].clone(), out[1].clone()
    with pytest.raises(K.KernelArgumentError, match="overlaps"):
        K.gather_kv(k_cache, v_cache, torch.tensor([3, 4, 5]), out=out)
    assert all(torch.equal(a, b) for a, b in zip(before, (kc, vc, *out)))


def test_gather_kv_into_other_rows_of_one_buffer_still_works():
    """Outputs in the same storage as the caches but apart from them (one scratch buffer with
    the caches in it, a layer other than the one read) are fine, as are K and V side by side."""
    buf = torch.zeros(3, 16, 2, 4)
    buf[0] = torch.arange(16.0).view(16, 1, 1)
    buf[1] = -buf[0]
    kc, vc, scratch = buf[0], buf[1], buf[2]
    k, v = K.gather_kv(kc, vc, torch.tensor([3, -1, 5]), out=(scratch[0:3], scratch[3:6]))
    assert k.data_ptr() == scratch[0:3].data_ptr()
    assert k[:, 0, 0].tolist() == [3.0, 0.0, 5.0] and v[:, 0, 0].tolist() == [-3.0, 0.0, -5.0]
    # MLA-style, one cache: no v_out.
    k, _ = K.gather_kv(kc, None, torch.tensor([7]), out=(scratch[8:9], None))
    assert k[0, 0, 0].item() == 7.0


def test_gather_kv_refuses_outputs_in_cache_memory_held_by_another_storage():
    """``torch.from_numpy`` of a cache's memory is a second storage over the same bytes: the
    overlap is one of addresses, refused as for a view of the cache."""
    kc, vc = caches(torch.float32)
    alias = torch.from_numpy(kc.numpy()[4:7])
    assert alias.untyped_storage().data_ptr() != kc.untyped_storage().data_ptr()
    before = kc.clone()
    with pytest.raises(K.KernelArgumentError, match="out\\[0\\] overlaps k_cache"):
        K.gather_kv(kc, vc, torch.tensor([3, 4, 5]), out=(alias, torch.zeros(3, 2, 4)))
    assert torch.equal(kc, before)
