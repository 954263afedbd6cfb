"""The plan keys of the directly launched kernels (``kvpool.kernels.launch``) determine
Triton's specialization, checked without a GPU.

A kept compiled kernel is launched for every later call with the same plan key, so two
calls with one key must be ones Triton would compile identically: same argument types,
same integers specialised to constants (1), same divisibility (16-byte aligned pointers,
integers that are multiples of 16), same constexprs and ``num_warps``. The GPU session
checks this on the launches it makes (``KVPOOL_CHECK_LAUNCH=1``); here each wrapper
(``store_kv``, ``gather_kv``, ``write_req_to_token``) is driven with CPU tensors over
layouts, dtypes, batch sizes, strided and misaligned views, its launches recorded
(``_codegen.recording``) beside the keys it computed, and every recorded launch is bound
by Triton's own binder for a CUDA target, as ``JITFunction.run`` binds it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import _codegen as cg
import pytest
import torch

REASON = cg.cuda_target_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def specialization(fn: Any, launch: cg.Launch) -> tuple:
    """What Triton compiles a launch for: options, signature, constexprs and attributes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    _, args, kwargs = launch
    options, signature, constexprs, attrs = cg._pack(fn, make_backend(GPUTarget("cuda", 90, 32)), args,
                                                    dict(kwargs))
    return (repr(options), tuple(signature.items()), tuple(sorted(constexprs.items())),
            tuple(sorted((k, repr(v)) for k, v in attrs.items())))


def keyed_launches(monkeypatch, module: Any, kernel_name: str, calls: list) -> tuple[Any, list]:
    """Runs each of ``calls`` with ``module``'s kernel recorded: (kernel, [(key, launch)])."""
    keys: list = []
    real = module.launch_planned

    def planned(launch, kernel, plans, key, make_plan, head, n, on_cuda):
        keys.append(key)
        real(launch, kernel, plans, key, make_plan, head, n, on_cuda)

    monkeypatch.setattr(module, "launch_planned", planned)
    with cg.recording(module, kernel_name) as rec:
        for call in calls:
            call()
    assert len(keys) == len(rec.calls) == len(calls)
    return rec.fn, list(zip(keys, rec.calls))


def assert_keys_determine_specialization(fn: Any, launches: list) -> None:
    by_key: dict[Any, list] = defaultdict(list)
    for key, launch in launches:
        by_key[key].append(specialization(fn, launch))
    shared = [specs for specs in by_key.values() if len(specs) > 1]
    # Calls that differ only in what Triton does not specialise on share a key: the
    # test compares something.
    assert len(shared) >= 3, f"only {len(shared)} keys with several launches"
    for specs in shared:
        assert all(s == specs[0] for s in specs[1:]), "one plan key, two specializations"
    # and the keys do tell Triton's variants apart
    assert len({s for specs in by_key.values() for s in specs}) > 1


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view whose data pointer is not 16-byte aligned."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)
    out = flat[1:].view(t.shape)
    out.copy_(t)
    return out


def index_forms(n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """0..n-1 as a contiguous tensor, a column of a batch tensor (stride 3) and a misaligned view."""
    base = torch.arange(n, dtype=dtype)
    column = torch.zeros((n, 3), dtype=dtype)
    column[:, 1] = base
    return [base, column[:, 1], misaligned(base)]


def test_req_table_keys(monkeypatch):
    import kvpool.kernels as K
    from kvpool.kernels import req_table

    calls = []
    for table_dtype in (torch.int32, torch.int64):
        for cols in (64, 72, 80):  # row strides: a multiple of 16 or not
            table = torch.zeros((8, cols), dtype=table_dtype)
            for b in (1, 2, 3, 7, 16, 32, 48):
                for idx in (torch.int64, torch.int32):
                    for slots in index_forms(b, idx):
                        for with_offsets in (False, True):
                            rows = torch.arange(b, dtype=idx) % 8
                            starts, counts = torch.zeros(b, dtype=idx), torch.ones(b, dtype=idx)
                            offsets = torch.arange(b, dtype=idx) if with_offsets else None
                            calls.append(lambda t=table, r=rows, s=starts, c=counts, x=slots, o=offsets:
                                         K.write_req_to_token(t, r, s, c, x, offsets=o))
    fn, launches = keyed_launches(monkeypatch, req_table, "_write_req_to_token_kernel", calls)
    assert_keys_determine_specialization(fn, launches)


def test_store_keys(monkeypatch):
    import kvpool.kernels as K
    from kvpool.kernels import store

    calls = []
    for layout in ("token", "paged"):
        shape = (512, 8, 64) if layout == "token" else (64, 16, 8, 64)
        for dtype in (torch.bfloat16, torch.float16):
            kc, vc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
            for n in (1, 2, 7, 16, 32, 48):
                for slots in index_forms(n, torch.int64) + index_forms(n, torch.int32):
                    k, v = torch.ones((n, 8, 64), dtype=dtype), torch.ones((n, 8, 64), dtype=dtype)
                    for kk, vv in ((k, v), (misaligned(k), v), (k, misaligned(v))):
                        calls.append(lambda kc=kc, vc=vc, s=slots, k=kk, v=vv: K.store_kv(kc, vc, s, k, v))
    fn, launches = keyed_launches(monkeypatch, store, "_store_kv_kernel", calls)
    assert_keys_determine_specialization(fn, launches)


def test_gather_keys(monkeypatch):
    import kvpool.kernels as K
    from kvpool.kernels import gather

    calls = []
    for layout in ("token", "paged"):
        shape = (512, 8, 64) if layout == "token" else (64, 16, 8, 64)
        kc, vc = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
        for n in (1, 2, 7, 16, 32, 48):
            for slots in index_forms(n, torch.int64) + index_forms(n, torch.int32):
                calls.append(lambda kc=kc, vc=vc, s=slots: K.gather_kv(kc, vc, s))
                calls.append(lambda kc=kc, s=slots: K.gather_kv(kc, None, s))
    fn, launches = keyed_launches(monkeypatch, gather, "_gather_kv_kernel", calls)
    assert_keys_determine_specialization(fn, launches)
