"""Outside-style sweep: gather_kv into an fp8 out_dtype from a wider cache, with values past
the fp8 format's finite range. The GPU kernel converts with ``cvt.rn.satfinite`` (checked
below in the PTX compiled for Hopper on this CPU machine), which saturates to the format's
largest finite value (NaN stays NaN); the torch path cast with ``.to()``, which takes
float8_e5m2 past 57344 (infinities included) to inf. Now both saturate."""

from __future__ import annotations

import re

import pytest
import torch

import kvpool.kernels as K

BIG = [1e5, float("inf"), -float("inf"), -7e4, 57344.0, 3.0]
E5M2_MAX = 57344.0


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scale", [None, 2.0], ids=["no-scale", "scale"])
def test_gather_into_e5m2_saturates_on_the_torch_path(cache_dtype, scale):
    kc = torch.tensor(BIG + [float("nan")]).view(-1, 1, 1).expand(-1, 1, 2).to(cache_dtype).contiguous()
    k, _ = K.gather_kv(kc, None, torch.arange(len(BIG) + 1), out_dtype=torch.float8_e5m2, k_scale=scale)
    got = k[:, 0, 0].float()
    s = 1.0 if scale is None else scale
    want = torch.tensor(BIG).to(cache_dtype).float().mul(s).clamp(-E5M2_MAX, E5M2_MAX)
    assert torch.equal(got[:-1], want.to(torch.float8_e5m2).float())
    assert got[:-1].isfinite().all() and got[-1].isnan()


def test_gather_into_e4m3fn_saturates_as_before():
    kc = torch.tensor(BIG).view(-1, 1, 1).expand(-1, 1, 2).contiguous()
    k, _ = K.gather_kv(kc, None, torch.arange(len(BIG)), out_dtype=torch.float8_e4m3fn)
    assert k[:, 0, 0].float().tolist() == [448.0, 448.0, -448.0, -448.0, 448.0, 3.0]


def test_the_gpu_gather_into_fp8_converts_with_satfinite():
    """The behaviour the torch path now matches, read from the PTX (no GPU needed)."""
    cg = pytest.importorskip("_codegen")
    reason = cg.cuda_target_unavailable()
    if reason is not None:
        pytest.skip(reason)
    from kvpool.kernels import gather as gather_mod

    for cache_dtype, out, fmt in [(torch.float32, torch.float8_e5m2, "e5m2"), (torch.bfloat16, torch.float8_e5m2, "e5m2"),
                                  (torch.float32, torch.float8_e4m3fn, "e4m3")]:
        with cg.recording(gather_mod, "_gather_kv_kernel") as rec:
            K.gather_kv(torch.zeros(64, 8, 128, dtype=cache_dtype), None, torch.arange(4), out_dtype=out)
        ptx, _ = cg.compile_launch(gather_mod._gather_kv_kernel, rec.calls[0])
        cvts = {c for c in re.findall(r"cvt[.\w]*", ptx) if fmt in c}
        assert cvts and all(".satfinite." in c for c in cvts), (cache_dtype, out, cvts)
