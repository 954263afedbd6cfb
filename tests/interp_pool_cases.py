"""KVPool's own paths through the Triton kernels, run on CPU through the Triton interpreter: a
pool's writes and extends through the kernels against its torch path, and copy-on-write.

Not collected by the normal session (the file name does not match test_*.py):
tests/test_kernels_interp.py runs it in the same child pytest as interp_kernels_cases.py, with
TRITON_INTERPRET=1 set before anything imports kvpool.kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guard against mis-collection
    pytest.skip("run by tests/test_kernels_interp.py with TRITON_INTERPRET=1", allow_module_level=True)

import kvpool  # noqa: E402
from kvpool.testing.kernel_cases import FP8, same  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float16, FP8], ids=str)
@pytest.mark.parametrize("layout,page_size,mla,heads,dim", [
    ("token", 1, False, 2, 24), ("paged", 4, False, 2, 24), ("token", 2, True, 1, 16),
    # Odd geometry: 3 heads of 80 (neither a power of two), 5-slot pages.
    ("paged", 5, False, 3, 80),
])
def test_pool_kernel_path_matches_torch_path(dtype, layout, page_size, mla, heads, dim):
    """KVPool moves K/V and table entries only through kvpool.kernels. Under the
    interpreter a CPU pool's writes run the Triton kernels, and with its host-table
    shortcut off its extends take the CUDA path (extend_packed, one copy, the table
    kernel); it must end up identical to a twin pool run on the torch backend."""
    import contextlib

    import numpy as np

    from kvpool.kernels import _common

    kw = dict(kv_lora_rank=12, qk_rope_head_dim=4) if mla else {}

    def make():
        return kvpool.KVPool(2, heads, dim, dtype=dtype, num_pages=16, page_size=page_size, max_requests=4,
                             max_context_len=32, layout=layout, **kw)

    fast, slow = make(), make()
    assert fast._table_np is not None
    fast._table_np = None

    @contextlib.contextmanager
    def backend(pool):
        """The torch backend for the twin (the kernels read INTERPRET at each call)."""
        if pool is fast:
            yield
            return
        _common.INTERPRET = False
        try:
            yield
        finally:
            _common.INTERPRET = True
    gen = torch.Generator().manual_seed(0)
    for pool in (fast, slow):
        if pool.k_scale is not None:
            pool.v_scale.fill_(2.0)
            pool.k_scale.fill_(0.5)  # MLA: v_scale is k_scale (one latent cache)
    hs = [p.open(3) for p in (fast, slow)]
    for counts in ([3, 0, 5], [1, 1, 1]):
        res = []
        for p, h in zip((fast, slow), hs):
            with backend(p):
                res.append(p.extend(h, np.asarray(counts)))
        assert np.array_equal(res[0].slots, res[1].slots)
        n = len(res[0].slots)
        cd = fast.compute_dtype
        # fp16 values times a power of two: exact in fp8 after the scale, so both paths agree bitwise.
        k = (torch.randn((n, heads, dim), generator=gen).to(dtype).to(torch.float32) * 0.5).to(cd)
        v = (torch.randn((n, heads, dim), generator=gen).to(dtype).to(torch.float32) * 2.0).to(cd)
        slots = torch.from_numpy(res[0].slots)
        for layer in range(2):
            for p in (fast, slow):
                with backend(p):
                    if mla:
                        p.write(layer, slots, k)
                    else:
                        p.write(layer, slots, k, v)
    assert torch.equal(fast.req_to_token, slow.req_to_token)
    for a, b in zip(fast.k_buffers + fast.v_buffers, slow.k_buffers + slow.v_buffers):
        assert same(a, b)
    probe = torch.cat([slots, torch.tensor([-1, 0])])  # padding reads zeros, slot 0 reads the sink
    for layer in range(2):
        got = []
        for p in (fast, slow):
            with backend(p):
                got.append(p.read(layer, probe))
        for a, b in zip(*got):
            assert a.dtype == fast.compute_dtype and same(a, b)


@pytest.mark.parametrize("page_size", [1, 4])
def test_pool_copy_on_write_through_kernels(page_size):
    """Shared pages on the kernel path: a CPU pool with its host-table shortcut
    off takes the CUDA path (extend_packed, the table kernel, copy_slots for
    copy-on-write, the moved positions' table entries) under the interpreter,
    and must end up bitwise identical to a twin run on the torch backend; each
    forked request reads back its own K/V."""
    from kvpool.kernels import _common

    def make():
        return kvpool.KVPool(2, 2, 8, dtype=torch.float16, num_pages=24, page_size=page_size, max_requests=6,
                             max_context_len=32)

    fast, slow = make(), make()
    fast._table_np = None
    seqs = {}
    for pool in (fast, slow):
        _common.INTERPRET = pool is fast
        try:
            h = pool.open(1)
            pool.extend(h, 6, tokens=list(range(6)))
            kids = pool.fork(h[0], 2)
            hs = [int(h[0])] + [int(x) for x in kids]
            for step in range(3):
                r = pool.extend(hs, 1, tokens=[10 * i + step for i in range(3)])
                k = torch.randn((3, 2, 8), generator=torch.Generator().manual_seed(step)).half()
                for layer in range(2):
                    pool.write(layer, r.out_cache_loc, k + layer, -k)
            if page_size > 1:
                assert len(pool.allocator.take_copies()[0]) == 0, "extend ran its copies itself"
            seqs[id(pool)] = [pool.slots(x).tolist() for x in hs]
            rows = pool.rows(hs)
            for x, row in zip(hs, rows):
                n = pool.length(x)
                assert pool.req_to_token[row, :n].tolist() == pool.slots(x).tolist()
        finally:
            _common.INTERPRET = True
    assert seqs[id(fast)] == seqs[id(slow)]
    for a, b in zip(fast.named_tensors(), slow.named_tensors()):
        assert torch.equal(a[1], b[1]), a[0]


def test_pool_write_takes_its_layer_stores_not_the_generic_path(monkeypatch):
    """A Triton pool's eager write stores through ``kernels.layer_stores`` (what never changes
    for the pool read once), not ``kernels.ops.store_rows``: the same rows land either way, and
    a write that fell back to the generic path (its host time ~1.5x) fails here."""
    import numpy as np

    from kvpool.kernels import ops
    from kvpool.testing.kernel_cases import same

    pool = kvpool.KVPool(2, 2, 24, dtype=torch.float16, num_pages=16, page_size=4, max_requests=2,
                         max_context_len=16, layout="paged")
    slots = torch.as_tensor(pool.extend(pool.open(1), np.asarray([5])).slots)
    k = torch.randn((5, 2, 24), generator=torch.Generator().manual_seed(1)).half()

    def refused(*_a, **_k):
        raise AssertionError("the pool's eager write took the generic store_rows")

    monkeypatch.setattr(ops, "store_rows", refused)
    import kvpool.rows as rows_module
    monkeypatch.setattr(rows_module, "store_rows", refused)
    pool.write(1, slots, k, -k)
    got_k, got_v = pool.read(1, slots)
    assert same(got_k, k) and same(got_v, -k)
    assert bool((pool.k_buffers[0] == 0).all()), "layer 0 untouched"
