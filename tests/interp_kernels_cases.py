"""Triton kernels vs the torch reference, run on CPU through the Triton interpreter.

Not collected by the normal session (the file name does not match test_*.py):
tests/test_kernels_interp.py runs this module in a child pytest with
TRITON_INTERPRET=1 set before anything imports kvpool.kernels (the variable is
read when @triton.jit runs), and reports each test here as its own result.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guard against mis-collection
    pytest.skip("run by tests/test_kernels_interp.py with TRITON_INTERPRET=1", allow_module_level=True)

import kvpool  # noqa: E402
import kvpool.kernels as K  # noqa: E402
from kvpool.kernels import _ref  # noqa: E402
from kvpool.testing.kernel_cases import (  # noqa: E402
    CACHE_DTYPES,
    FP8,
    LAYOUTS,
    bits,
    build_store,
    clone_opt,
    exact_values,
    make_caches,
    random_bytes,
    same,
    store_cases,
    untouched_equal,
)

# The interpreter runs each program in Python: keep examples few and shapes small.
SETTINGS = settings(max_examples=int(os.environ.get("KVPOOL_INTERP_EXAMPLES", "25")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def test_interpreter_is_active():
    assert K.INTERPRET, "kvpool.kernels was imported without TRITON_INTERPRET=1"
    from kvpool.kernels import _common
    assert _common.use_triton(torch.zeros(1)), "CPU tensors must go through Triton here"


@SETTINGS
@given(case=store_cases(), seed=st.integers(0, 2**31 - 1))
def test_store_matches_reference(case, seed):
    kc, vc, slots, k, v, ks, vs = build_store(case, seed)
    kc0, vc0 = kc.clone(), clone_opt(vc)
    rk, rv = kc.clone(), clone_opt(vc)
    _ref.store_kv_ref(rk, rv, slots, k, v, ks, vs)
    K.store_kv(kc, vc, slots, k, v, ks, vs)
    assert same(kc, rk)
    assert untouched_equal(kc0, kc, case.slots)
    if vc is not None:
        assert same(vc, rv)
        assert untouched_equal(vc0, vc, case.slots)


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_store_all_padding_and_empty(dtype, layout):
    gen = torch.Generator().manual_seed(1)
    kc, vc = make_caches(layout, 8, 4, 2, 24, dtype, gen)
    before = (kc.clone(), vc.clone())
    in_dt = torch.float16 if dtype == FP8 else dtype
    for n in (0, 5):
        slots = torch.full((n,), -1, dtype=torch.int64)
        x = torch.randn((n, 2, 24)).to(in_dt)
        K.store_kv(kc, vc, slots, x, x, 1.0 if dtype == FP8 else None, 1.0 if dtype == FP8 else None)
        assert same(kc, before[0]) and same(vc, before[1])


# Row shapes whose tiles differ: several tokens per program (1 x 128), flattened
# heads (8 x 72, 576), and head_dim 72 in a cache whose heads are 80 apart.
ROW_SHAPES = [(8, 128, "rows"), (8, 64, "rows"), (1, 128, "rows"), (1, 576, "rows"), (8, 72, "rows"),
              (8, 72, "strided"), (2, 7, "rows")]


def _row_caches(layout, heads, dim, dtype, gen):
    if layout == "strided":  # [S, H, 80][..., :72]: rows are not one contiguous run
        return tuple(random_bytes((24, heads, dim + 8), dtype, gen)[..., :dim] for _ in range(2))
    return make_caches("paged", 24, 4, heads, dim, dtype, gen)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, FP8], ids=str)
@pytest.mark.parametrize("heads,dim,layout", ROW_SHAPES, ids=[f"h{h}d{d}-{lay}" for h, d, lay in ROW_SHAPES])
def test_row_shapes_match_reference(dtype, heads, dim, layout):
    """store, gather and copy on every tile shape, with a batch that is not a multiple
    of the tokens per program and padding in the middle: bitwise like the reference,
    nothing else touched."""
    gen = torch.Generator().manual_seed(heads * 1000 + dim)
    kc, vc = _row_caches(layout, heads, dim, dtype, gen)
    slots_l = [5, -1, 17, 2, 9, 23, -1]
    slots = torch.tensor(slots_l)
    in_dt = torch.float16 if dtype == FP8 else dtype
    scale = 0.5 if dtype == FP8 else None
    k = exact_values(len(slots_l), heads, dim, dtype, in_dt, scale or 1.0, gen)
    v = exact_values(len(slots_l), heads, dim, dtype, in_dt, scale or 1.0, gen)
    before = (kc.clone(), vc.clone())
    rk, rv = kc.clone(), vc.clone()
    _ref.store_kv_ref(rk, rv, slots, k, v, scale, scale)
    K.store_kv(kc, vc, slots, k, v, scale, scale)
    assert same(kc, rk) and same(vc, rv)
    assert untouched_equal(before[0], kc, slots_l) and untouched_equal(before[1], vc, slots_l)
    probe = torch.tensor([17, -1, 5, 23, 0])
    got, want = K.gather_kv(kc, vc, probe), _ref.gather_kv_ref(kc, vc, probe)
    assert same(got[0], want[0]) and same(got[1], want[1])
    src, dst = torch.tensor([17, 5, -1, 9, 2]), torch.tensor([1, 3, 4, -1, 20])
    ref = [kc.clone(), vc.clone()]
    _ref.copy_slots_ref(ref, src, dst)
    caches = [kc, vc]
    before = [t.clone() for t in caches]
    K.copy_slots(caches, src, dst)
    for a, b, b0 in zip(caches, ref, before):
        assert same(a, b) and untouched_equal(b0, a, [1, 3, 20])


def test_store_fp8_clamps_and_scales():
    kc = torch.zeros((4, 1, 4), dtype=FP8)
    k = torch.tensor([[[1000.0, -1000.0, 3.0, -0.5]]])
    K.store_kv(kc, None, torch.tensor([2]), k, None, k_scale=torch.tensor([0.5]))
    assert kc[2, 0].float().tolist() == [448.0, -448.0, 6.0, -1.0]
    assert (kc.view(torch.uint8)[[0, 1, 3]] == 0).all()  # bytes: torch 2.4 has no CPU indexing of fp8


def test_store_slot_zero_is_a_normal_slot():
    kc = torch.zeros((4, 1, 3))
    K.store_kv(kc, None, torch.tensor([0, -1]), torch.ones((2, 1, 3)), None)
    assert kc[0].eq(1).all() and kc[1:].eq(0).all()


@SETTINGS
@given(case=store_cases(), seed=st.integers(0, 2**31 - 1), dup=st.booleans())
def test_gather_matches_reference(case, seed, dup):
    kc, vc, slots, _, _, _, _ = build_store(case, seed)
    if dup and len(case.slots) > 0:  # gathering the same slot twice is fine
        slots = torch.cat([slots, slots[:1]])
    k, v = K.gather_kv(kc, vc, slots)
    rk, rv = _ref.gather_kv_ref(kc, vc, slots)
    assert same(k, rk) and k.is_contiguous()
    assert (v is None) == (vc is None)
    if vc is not None:
        assert same(v, rv)


@SETTINGS
@given(case=store_cases(dtypes=[torch.float16, torch.float32, FP8]), seed=st.integers(0, 2**31 - 1),
       out_dtype=st.sampled_from([torch.float32, torch.float16]))
def test_gather_dequantizes(case, seed, out_dtype):
    kc, vc, slots, _, _, _, _ = build_store(case, seed)
    # Replace garbage with finite values so x * scale is exact and comparable.
    kc.copy_(torch.randn(kc.shape).to(kc.dtype))
    if vc is not None:
        vc.copy_(torch.randn(vc.shape).to(vc.dtype))
    ks, vs = torch.tensor([0.25]), 2.0
    k, v = K.gather_kv(kc, vc, slots, out_dtype=out_dtype, k_scale=ks, v_scale=vs)
    rk, rv = _ref.gather_kv_ref(kc, vc, slots, out_dtype, ks, vs)
    assert k.dtype == out_dtype and same(k, rk)
    if vc is not None:
        assert same(v, rv)


@SETTINGS
@given(layout=st.sampled_from(["token", "paged"]), layers=st.integers(1, 3),
       dtype=st.sampled_from(CACHE_DTYPES), heads=st.sampled_from([1, 2, 3]),
       dim=st.sampled_from([5, 32, 48]), data=st.data(), mixed=st.booleans())
def test_copy_matches_reference(layout, layers, dtype, heads, dim, data, mixed):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    page = 4 if layout == "paged" else 1
    num_slots = 16
    caches = []
    for _ in range(layers):
        caches.extend(make_caches(layout, num_slots, page, heads, dim, dtype, gen))
    if mixed:  # a cache of another dtype/shape: a second group (second launch)
        caches.append(make_caches("token", num_slots, 1, 1, 3, torch.float32, gen)[0])
    n = data.draw(st.integers(0, 6))
    perm = torch.randperm(num_slots, generator=gen).tolist()
    src, dst = perm[:n], perm[n:2 * n]  # disjoint
    pad = data.draw(st.lists(st.sampled_from(["none", "src", "dst"]), min_size=n, max_size=n))
    src = [-1 if p == "src" else s for s, p in zip(src, pad)]
    dst = [-1 if p == "dst" else s for s, p in zip(dst, pad)]
    sd = data.draw(st.sampled_from([torch.int32, torch.int64]))
    src_t, dst_t = torch.tensor(src, dtype=sd), torch.tensor(dst, dtype=sd)
    init = [t.clone() for t in caches]
    ref = [t.clone() for t in caches]
    _ref.copy_slots_ref(ref, src_t, dst_t)
    K.copy_slots(caches, src_t, dst_t)
    written = [d for s, d in zip(src, dst) if s >= 0 and d >= 0]
    for got, want in zip(caches, ref):
        assert same(got, want)
    for before, after in zip(init, caches):
        assert untouched_equal(before, after, written)


def test_copy_offsets_table_is_cached():
    from kvpool.kernels.copy_tables import TABLES
    caches = [torch.zeros((8, 1, 4)) for _ in range(3)]
    caches[0][1] = 7.0
    K.copy_slots(caches, torch.tensor([1]), torch.tensor([2]))
    n_cached = len(TABLES)
    K.copy_slots(caches, torch.tensor([1]), torch.tensor([3]))
    assert len(TABLES) == n_cached
    assert caches[0][2].eq(7).all() and caches[0][3].eq(7).all() and caches[1].eq(0).all()


@SETTINGS
@given(data=st.data(), table_dtype=st.sampled_from([torch.int32, torch.int64]),
       idx_dtype=st.sampled_from([torch.int32, torch.int64]), pass_offsets=st.booleans())
def test_write_req_to_token_matches_reference(data, table_dtype, idx_dtype, pass_offsets):
    rows_total, ctx = 9, 40
    b = data.draw(st.integers(0, 8))
    rows = data.draw(st.lists(st.integers(0, rows_total - 1), min_size=b, max_size=b, unique=True))
    rows = [r if data.draw(st.integers(0, 5)) else -1 for r in rows]  # some padded requests
    counts = [data.draw(st.integers(0, 30)) for _ in range(b)]
    starts = [data.draw(st.integers(0, ctx - c)) for c in counts]
    total = sum(counts)
    slots = torch.randint(1, 10**6, (total,), dtype=idx_dtype)
    table = torch.randint(-5, 5, (rows_total, ctx), dtype=table_dtype)
    t = lambda xs: torch.tensor(xs, dtype=idx_dtype)  # noqa: E731
    offsets = None
    if pass_offsets:
        offsets = t([sum(counts[:i]) for i in range(b)])
    ref = table.clone()
    _ref.write_req_to_token_ref(ref, t(rows), t(starts), t(counts), slots)
    K.write_req_to_token(table, t(rows), t(starts), t(counts), slots, offsets=offsets)
    assert torch.equal(table, ref)


def test_write_req_to_token_refuses_offsets_that_are_not_the_prefix_sum():
    """The kernel reads slots at offsets as given (the torch path sums the counts): offsets
    past the slots read the heap into the table before this was checked."""
    table = torch.zeros(4, 8, dtype=torch.int32)
    args = (torch.tensor([0, 2]), torch.tensor([1, 6]), torch.tensor([3, 2]), torch.arange(100, 105))
    for bad in ([1000, 100000], [-50, 0], [2, 0]):
        with pytest.raises(K.KernelArgumentError, match="exclusive prefix sum"):
            K.write_req_to_token(table, *args, offsets=torch.tensor(bad))
        assert not table.any()
    K.write_req_to_token(table, *args, offsets=torch.tensor([0, 3]))
    assert table[0, 1:4].tolist() == [100, 101, 102] and table[2, 6:8].tolist() == [103, 104]


def test_write_req_to_token_refuses_spans_whose_int64_end_wraps():
    """start + count past 2**63 wrapped negative and passed the span check: the kernel then read
    past the slots and wrote what it found into the table."""
    table = torch.zeros(4, 8, dtype=torch.int32)
    with pytest.raises(K.KernelArgumentError, match="is outside the row"):
        K.write_req_to_token(table, torch.tensor([0, 0, 1]), torch.tensor([1, 1, 0]),
                             torch.tensor([2**63 - 1, 2**63 - 1, 3]), torch.tensor([5, 6, 7]))
    assert not table.any()


def test_write_req_to_token_long_request_loops():
    table = torch.zeros((2, 3000), dtype=torch.int32)
    slots = torch.arange(1, 2501, dtype=torch.int64)
    K.write_req_to_token(table, torch.tensor([1]), torch.tensor([100]), torch.tensor([2500]), slots)
    assert torch.equal(table[1, 100:2600], slots.int())
    assert table[0].eq(0).all() and table[1, :100].eq(0).all() and table[1, 2600:].eq(0).all()


def test_prefill_rows_per_program():
    # n >= 2048 switches to several tokens per program; check the tail masking.
    from kvpool.kernels.store import rows_per_program
    n = 2051
    assert rows_per_program(n, 2) > 1
    kc = torch.zeros((4096, 1, 2), dtype=torch.float16)
    slots = torch.randperm(4096)[:n]
    slots[::7] = -1
    k = torch.randn((n, 1, 2)).half()
    ref = kc.clone()
    _ref.store_kv_ref(ref, None, slots, k, None)
    K.store_kv(kc, None, slots, k, None)
    assert torch.equal(bits(kc), bits(ref))


def _strided(xs, dtype=torch.int64):
    """xs as a 1-D view with stride 2 (each value twice in the base, so a kernel that
    ignored the stride would read other values of the same batch, never past it)."""
    return torch.tensor(xs, dtype=dtype).repeat_interleave(2)[::2]


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=str)
def test_index_tensors_with_a_stride(idx_dtype):
    """Slot, row, start and count tensors are 1-D views of any stride (a column of a
    2-D batch tensor, a [::2] slice, an expanded scalar): every kernel reads element i
    at i * stride, like the torch path, written out here element by element."""
    gen = torch.Generator().manual_seed(3)
    kc, vc = make_caches("paged", 15, 3, 3, 80, torch.float16, gen)  # page size 3, 3 heads
    rows = torch.randn((4, 3, 80), generator=gen).half()
    slots_l = [13, -1, 2, 7]
    want = [kc.clone(), vc.clone()]
    for i, s in enumerate(slots_l):
        if s >= 0:
            want[0][s // 3, s % 3], want[1][s // 3, s % 3] = rows[i], -rows[i]
    K.store_kv(kc, vc, _strided(slots_l, idx_dtype), rows, -rows)
    assert same(kc, want[0]) and same(vc, want[1])

    probe_l = [7, 13, -1, 2]
    k, _ = K.gather_kv(kc, None, _strided(probe_l, idx_dtype))
    assert same(k, torch.stack([kc[s // 3, s % 3] if s >= 0 else torch.zeros_like(kc[0, 0]) for s in probe_l]))
    k, _ = K.gather_kv(kc, None, torch.tensor([7], dtype=idx_dtype).expand(3))  # stride 0
    assert same(k, kc[2, 1].expand(3, 3, 80))

    src_l, dst_l = [13, 2, -1, 7], [4, 10, 5, 0]
    want = [kc.clone(), vc.clone()]
    for c in want:
        for s, d in zip(src_l, dst_l):
            if s >= 0 and d >= 0:
                c[d // 3, d % 3] = c[s // 3, s % 3]
    caches = [kc, vc]
    K.copy_slots(caches, _strided(src_l, idx_dtype), _strided(dst_l, idx_dtype))
    assert same(caches[0], want[0]) and same(caches[1], want[1])

    table = torch.zeros((4, 10), dtype=torch.int32)
    t_rows, t_starts, t_counts = [2, -1, 0, 3], [1, 0, 4, 0], [3, 2, 5, 0]
    new = list(range(100, 110))
    want = table.clone()
    pos = 0
    for r, st0, n in zip(t_rows, t_starts, t_counts):
        if r >= 0:
            want[r, st0:st0 + n] = torch.tensor(new[pos:pos + n], dtype=torch.int32)
        pos += n
    for offsets in (None, _strided([0, 3, 5, 10], idx_dtype)):
        t = table.clone()
        K.write_req_to_token(t, *(_strided(x, idx_dtype) for x in (t_rows, t_starts, t_counts, new)),
                             offsets=offsets)
        assert torch.equal(t, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, FP8])
@pytest.mark.parametrize("layout", ["token", "paged"])
def test_rows_that_view_the_cache_are_stored_as_at_the_call(dtype, layout):
    """On the CPU, rows may be views of the caches (moving rows within a layer): they are
    stored as they were at the call. Through the kernel they were read after the store had
    overwritten them (rows shifted by one slot copied the first row over and over)."""
    # One row a program (a row of 256 fills a tile): a program reads its row after earlier
    # programs stored theirs.
    # Values fp8 holds (its largest finite value is 448): arange up to 2047 made NaNs past it,
    # which Triton 3.0/3.2's interpreter stores as 448 and 3.9's as NaN. Rows 0-2, the ones
    # moved, still differ from each other.
    values = torch.arange(8 * 256, dtype=torch.float32)
    flat = (values % 448 if dtype == FP8 else values).reshape(8, 1, 256).to(dtype)
    kc = flat.view(4, 2, 1, 256) if layout == "paged" else flat
    vc = (-flat.float()).to(dtype).view(kc.shape)
    rows_k, rows_v = flat[0:3], vc.view(8, 1, 256)[0:3]  # K's rows a view of K's cache, V's of V's
    want_k, want_v = flat.clone(), vc.view(8, 1, 256).clone()
    want_k[1:4], want_v[1:4] = flat[0:3].clone(), vc.view(8, 1, 256)[0:3].clone()
    K.store_kv(kc, vc, torch.tensor([1, 2, 3]), rows_k, rows_v)
    assert same(flat, want_k) and same(vc.view(8, 1, 256), want_v)


def test_pool_write_of_rows_that_view_its_cache():
    """KVPool.write on a CPU pool goes through the kernel here: rows moved one slot up
    within a layer are stored as they were at the call."""
    import numpy as np

    from kvpool import KVPool
    pool = KVPool(1, 1, 256, dtype=torch.float16, num_pages=16, page_size=1, max_requests=2, max_context_len=16)
    slots = torch.as_tensor(pool.extend(pool.open(1), np.asarray([6])).slots).long()
    assert bool((slots[1:] == slots[:-1] + 1).all()), "consecutive slots, so rows [a:a+3] are one view"
    kb, vb = pool.k_buffers[0], pool.v_buffers[0]
    for i, s in enumerate(slots.tolist()):
        kb[s].fill_(i + 1)
        vb[s].fill_(-(i + 1))
    a = int(slots[0])
    want_k, want_v = kb.clone(), vb.clone()
    want_k[a + 1:a + 4], want_v[a + 1:a + 4] = kb[a:a + 3].clone(), vb[a:a + 3].clone()
    pool.write(0, slots[1:4], kb[a:a + 3], vb[a:a + 3])
    assert same(kb, want_k) and same(vb, want_v)


@pytest.mark.parametrize("cache_dt, out_dt", [(torch.float8_e4m3fn, torch.float8_e5m2),
                                              (torch.float8_e5m2, torch.float8_e4m3fn),
                                              (torch.float8_e4m3fn, torch.float64),
                                              (torch.bfloat16, torch.float64)])
def test_gather_converts_between_fp8_formats_and_to_float64(cache_dt, out_dt):
    """Triton has no direct cast from one fp8 format to the other, nor from fp8 to float64:
    the kernel raised an untyped InterpreterError where torch's path converted."""
    kc = torch.tensor([[[1.0, -0.5, 2.0, 0.0, 448.0 if cache_dt == torch.float8_e4m3fn else 3.5]]] * 4).to(cache_dt)
    k, _ = K.gather_kv(kc, None, torch.tensor([1, 3, -1]), out_dtype=out_dt)
    # indexed as bytes: torch 2.4 has no CPU indexing of fp8
    want = torch.cat([kc.view(torch.uint8)[[1, 3]].view(cache_dt).to(out_dt), torch.zeros((1, 1, 5), dtype=out_dt)])
    assert same(k, want)


def test_rows_that_are_negative_bit_views_are_stored_with_their_sign():
    """``z.conj().imag`` is a float view whose memory holds -imag (torch's negative bit): the
    kernel read the memory as it was, so the K/V stored had the wrong sign (on CUDA as here)."""
    z = torch.complex(torch.zeros(2, 1, 6), torch.arange(1.0, 13.0).view(2, 1, 6))
    k = z.conj().imag
    assert k.is_neg()
    kc, vc = torch.zeros(8, 1, 6), torch.zeros(8, 1, 6)
    K.store_kv(kc, vc, torch.tensor([3, 5]), k, -k.resolve_neg())
    assert torch.equal(kc[[3, 5]], k.resolve_neg()) and torch.equal(vc[[3, 5]], -k.resolve_neg())
    pool = kvpool.KVPool(1, 1, 6, dtype=torch.float32, num_slots=8, page_size=2)
    pool.write(0, [3, 5], k, k)
    assert torch.equal(pool.read(0, [3, 5])[0], k.resolve_neg())
