"""KVPool on odd geometries, on the CPU (torch) paths: head_dim not a power of two
(80, 96, 112), 1 and 3 KV heads, page sizes 1, 3, 5 and 48, fp16 / bf16 / fp32 /
fp8 (and MLA), token and paged layouts, with the host table and with the device
path (``extend_packed`` and the table written by torch).

One scenario per geometry: empty batches everywhere they are accepted, a prompt
that ends in a partly filled page, forks that extend into the shared page
(copy-on-write), a truncate into the shared part and a re-extend, the pool filled
to its last slot, padding and page-0 writes with ``strict`` off, refusals with it
on. After each phase every request's K and V are compared bitwise with a plain
per-position reference through ``read``, the layer views (``k_buffer`` indexed by
slot, in the pool's layout), ``gather_kv`` and its ``req_to_token`` row.
(``tests/interp_pool_cases.py`` runs the same kernels through Triton.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
from kvpool.kernels import gather_kv

FP8 = torch.float8_e4m3fn


def vals(n, h, d, gen):
    # Multiples of 0.25 in [-4, 4] are exact in fp8 e4m3, bf16 and fp16, so every
    # backend must store and read them back bitwise (fp8 scales stay 1).
    return torch.randint(-16, 17, (n, h, d), generator=gen).float() * 0.25


def run(dtype, layout, heads, dim, page, table_np, mla=False):
    """The scenario of the module docstring on one geometry; raises on the first mismatch."""
    gen = torch.Generator().manual_seed(heads * 1000 + dim * 10 + page)
    npages = 12 if page >= 16 else 40
    kw = dict(kv_lora_rank=dim - 16, qk_rope_head_dim=16) if mla else {}
    pool = kvpool.KVPool(2, heads, dim, dtype=dtype, page_size=page, num_pages=npages, max_requests=64,
                         max_context_len=npages * page, layout=layout, **kw)
    if not table_np:
        pool._table_np = None
    cd = pool.compute_dtype
    seq = {}  # handle -> per position, per layer: (k row, v row) as written

    def write_res(handles, counts, res, strict=False, slots_kind="loc"):
        n = len(res.slots)
        kvs = [(vals(n, heads, dim, gen), vals(n, heads, dim, gen)) for _ in range(2)]
        slots = res.out_cache_loc if slots_kind == "loc" else (res.slots if slots_kind == "np" else res.slots.tolist())
        for layer, (k, v) in enumerate(kvs):
            if mla:
                pool.write(layer, slots, k.to(cd), strict=strict)
            else:
                pool.write(layer, slots, k.to(cd), v.to(cd), strict=strict)
        at = 0
        for h, c in zip(handles, counts):
            for i in range(c):
                seq.setdefault(int(h), []).append([(kvs[layer][0][at + i], kvs[layer][1][at + i]) for layer in range(2)])
            at += c

    def verify():
        for h, s in seq.items():
            slots = pool.slots(h)
            assert len(slots) == len(s), (h, len(slots), len(s))
            if not len(slots):
                continue
            for layer in range(2):
                gk, gv = pool.read(layer, slots)
                wk = torch.stack([p[layer][0] for p in s]).to(cd)
                wv = torch.stack([p[layer][1] for p in s]).to(cd)
                if mla:
                    wv = wk[..., : pool.kv_lora_rank]
                assert torch.equal(gk, wk), f"K mismatch req {h} layer {layer}: {(gk != wk).nonzero()[:3].tolist()}"
                assert torch.equal(gv, wv), f"V mismatch req {h} layer {layer}"
                # through the public buffer views and the public gather
                kb = pool.k_buffer(layer)
                st = torch.from_numpy(slots)
                # indexed as bytes: torch < 2.5 has no CPU indexing of fp8 tensors
                kb8 = kb.view(torch.uint8)
                direct = (kb8[st] if layout == "token" else kb8[st // page, st % page]).view(kb.dtype)
                sc = None if pool.k_scale is None else pool.k_scale[layer:layer+1]
                assert torch.equal(direct.to(cd) if sc is None else (direct.float() * sc).to(cd), wk)
                g, _ = gather_kv(kb, None, st, out_dtype=cd, k_scale=sc)
                assert torch.equal(g, wk)
                # req_to_token row mirrors slots
                row = int(pool.rows([h])[0])
                assert pool.req_to_token[row, : len(slots)].tolist() == slots.tolist()
    # Empty batches, wherever they are accepted.
    h0, r0 = pool.admit([])
    assert len(h0) == 0 and len(r0.slots) == 0
    r = pool.extend(np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert len(r.slots) == 0 and r.out_cache_loc.numel() == 0
    e = torch.zeros((0, heads, dim), dtype=cd)
    for sl in (r.out_cache_loc, [], np.zeros(0, np.int64), torch.zeros(0, dtype=torch.int32)):
        if mla:
            pool.write(0, sl, e)
            pool.write(0, sl, e, strict=True)
        else:
            pool.write(0, sl, e, e)
            pool.write(0, sl, e, e, strict=True)
        k, v = pool.read(0, sl)
        assert k.shape == (0, heads, dim) and k.dtype == cd
    pt = pool.page_table(np.zeros(0, np.int64))
    assert pt.kv_indptr.tolist() == [0]
    assert len(pool.fork(pool.open(1)[0], 0)) == 0
    # requests
    L = page + max(1, page // 2)
    hs, res = pool.admit([L, 3])
    write_res(hs, [L, 3], res, strict=True)
    kids = pool.fork(int(hs[0]), 2)
    for k_ in kids:
        seq[int(k_)] = list(seq[int(hs[0])])
    allh = [int(hs[0]), int(hs[1])] + [int(x) for x in kids]
    for step, kind in zip(range(3), ("loc", "np", "list")):
        counts = [1, 1, 1, 2]
        r = pool.extend(allh, counts)
        write_res(allh, counts, r, strict=bool(step % 2), slots_kind=kind)
        verify()
    pool.check()
    # truncate a kid into the shared part, then extend (copy-on-write again)
    t = max(1, page - 1)
    pool.truncate([allh[2]], [t])
    seq[allh[2]] = seq[allh[2]][:t]
    r = pool.extend([allh[2]], [page + 1])
    write_res([allh[2]], [page + 1], r)
    verify()
    # empty extend of existing requests (counts 0)
    r = pool.extend(allh, [0, 0, 0, 0])
    assert len(r.slots) == 0
    # Fill the pool: the first real slot (page 1) and the very last slot get used.
    more = []
    while pool.free_slots > 0:
        n = page * min(pool.free_pages, 2)
        try:
            h, r = pool.admit([n])
        except kvpool.TooManyRequestsError:
            pool.close([allh.pop()])
            continue
        write_res(h, [n], r, strict=True)
        more.append(int(h[0]))
    held = set(int(s) for h in seq if pool.is_open(h) for s in pool.slots(h))
    seq = {h: s for h, s in seq.items() if pool.is_open(h)}
    # slot 'page' (first real slot) and num_slots-1 (last slot)
    assert page in held and pool.num_slots - 1 in held, (page, pool.num_slots - 1, sorted(held)[:5], sorted(held)[-5:])
    verify()
    # page-0 sink and negative padding with strict off leave requests intact
    k = vals(3, heads, dim, gen).to(cd)
    for layer in range(2):
        if mla:
            pool.write(layer, torch.tensor([0, -1, page - 1]), k)
        else:
            pool.write(layer, torch.tensor([0, -1, page - 1]), k, k)
    for sl in ([0], [-1], [pool.num_slots - 1, pool.num_slots - 1]):
        try:
            if mla:
                pool.write(0, torch.tensor(sl), k[: len(sl)], strict=True)
            else:
                pool.write(0, torch.tensor(sl), k[: len(sl)], k[: len(sl)], strict=True)
            raise AssertionError(f"strict accepted {sl}")
        except (kvpool.ReservedSlotError, kvpool.DuplicateSlotError):
            pass
    for sl in ([pool.num_slots], [-2**40]):
        try:
            if mla:
                pool.write(0, sl, k[:1])
            else:
                pool.write(0, sl, k[:1], k[:1])
            if sl[0] >= 0:
                raise AssertionError(f"accepted {sl}")
        except kvpool.SlotRangeError:
            pass
    verify()
    gk, _ = pool.read(0, torch.tensor([-1, pool.num_slots - 1]))
    assert torch.equal(gk[0], torch.zeros_like(gk[0]))
    pool.check()



SHAPES = [(1, 80, 1, "token"), (3, 96, 3, "paged"), (3, 112, 5, "token"), (1, 112, 48, "paged"),
          (3, 80, 48, "token")]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, FP8]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,dim,page,layout", SHAPES, ids=[f"h{h}d{d}p{p}-{lay}" for h, d, p, lay in SHAPES])
def test_odd_geometry_reads_back_bitwise(dtype, heads, dim, page, layout):
    run(dtype, layout, heads, dim, page, table_np=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=str)
@pytest.mark.parametrize("heads,dim,page,layout", SHAPES[1:3], ids=[f"h{h}d{d}p{p}-{lay}" for h, d, p, lay in SHAPES[1:3]])
def test_odd_geometry_device_path_reads_back_bitwise(dtype, heads, dim, page, layout):
    run(dtype, layout, heads, dim, page, table_np=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=str)
@pytest.mark.parametrize("page", [1, 5])
def test_odd_geometry_mla_reads_back_bitwise(dtype, page):
    run(dtype, "paged", 1, 80, page, table_np=True, mla=True)
