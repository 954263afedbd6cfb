"""Outside review of kvpool.kernels and the graph runner on CPU.

The torch CPU path runs in this session; the Triton kernels run in one child
interpreter (TRITON_INTERPRET=1 must be set before kvpool.kernels is imported),
which checks both backends against a naive per-row loop at shapes the hypothesis
cases may not reach (page size 1 and 3, head_dim 80/96/3, one KV head, MLA,
fp8 with a tensor scale, slots at both ends of the pool, non-contiguous rows).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import kvpool
import kvpool.kernels as K
from kvpool.cuda_graph import DecodeGraphRunner


def _caches(n=8, h=2, d=4, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, h, d, generator=gen).to(dtype), torch.randn(n, h, d, generator=gen).to(dtype)


def _unchanged(before, *after):
    return all(torch.equal(a, b) for a, b in zip(before, after))


# ----- bad input: typed errors, nothing written ---------------------------------------

@pytest.mark.parametrize("paged", [False, True], ids=["token", "paged"])
@pytest.mark.parametrize("bad", [8, 100, 2**40])
def test_store_kv_out_of_range_slot_is_slot_range_error_and_writes_nothing(paged, bad):
    # Was: IndexError from index_copy_ after the rows before the bad slot had been
    # stored in K (and heap corruption under the interpreter).
    kc, vc = _caches()
    before = (kc.clone(), vc.clone())
    kk, vv = (kc.view(2, 4, 2, 4), vc.view(2, 4, 2, 4)) if paged else (kc, vc)
    rows = torch.ones(2, 2, 4)
    with pytest.raises(kvpool.SlotRangeError, match=rf"slots\[1\] = {bad} .*\[0, 8\)"):
        K.store_kv(kk, vv, torch.tensor([1, bad]), rows, rows)
    assert _unchanged(before, kc, vc)


def test_gather_and_copy_out_of_range_slots_are_slot_range_errors():
    kc, vc = _caches()
    before = (kc.clone(), vc.clone())
    with pytest.raises(kvpool.SlotRangeError, match=r"slots\[0\] = 8"):
        K.gather_kv(kc, vc, torch.tensor([8, 1], dtype=torch.int32))
    with pytest.raises(kvpool.SlotRangeError, match=r"dst_slots\[1\] = 9"):
        K.copy_slots([kc, vc], torch.tensor([1, 2]), torch.tensor([3, 9]))
    with pytest.raises(kvpool.SlotRangeError, match=r"src_slots\[0\] = 8"):
        K.copy_slots([kc, vc], torch.tensor([8, 2]), torch.tensor([3, 4]))
    assert _unchanged(before, kc, vc)


def test_negative_and_boundary_slots_still_accepted():
    kc, vc = _caches()
    rows = torch.arange(3 * 8, dtype=torch.float32).view(3, 2, 4)
    K.store_kv(kc, vc, torch.tensor([0, -1, 7]), rows, -rows)
    assert torch.equal(kc[0], rows[0]) and torch.equal(kc[7], rows[2]) and torch.equal(vc[7], -rows[2])
    k, v = K.gather_kv(kc, vc, torch.tensor([7, -5, 0]))
    assert torch.equal(k[0], rows[2]) and not k[1].any() and torch.equal(v[2], -rows[0])
    K.copy_slots([kc, vc], torch.tensor([7, -1]), torch.tensor([1, 2]))
    assert torch.equal(kc[1], rows[2])


def test_v_cache_on_another_device_is_refused_before_k_is_written():
    # Was: K stored, then a RuntimeError from index_copy_ on V (v_cache's device unchecked).
    kc, vc = _caches()
    before = kc.clone()
    rows = torch.ones(1, 2, 4)
    with pytest.raises(kvpool.TensorDeviceError, match="v_cache is on meta"):
        K.store_kv(kc, vc.to("meta"), torch.tensor([1]), rows, rows)
    assert torch.equal(kc, before)
    with pytest.raises(kvpool.TensorDeviceError, match="v_cache is on meta"):
        K.gather_kv(kc, vc.to("meta"), torch.tensor([1]))


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference"])
def test_store_kv_of_rows_that_require_grad_leaves_the_cache_out_of_autograd(mode):
    # Was (grad mode): the cache became requires_grad with an IndexCopyBackward grad_fn
    # (the Triton path never does), which audit() and later in-place writes trip over.
    kc, vc = _caches()
    k = torch.randn(2, 2, 4, requires_grad=True)
    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}[mode]
    with ctx():
        K.store_kv(kc, vc, torch.tensor([1, 2]), k, k * 2)
    assert not kc.requires_grad and kc.grad_fn is None and not vc.requires_grad
    assert torch.equal(kc[1:3], k.detach()) and not kc.is_inference()


def _inference(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


def _grad_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_(True)


# Each kernel with one destination that torch would refuse to change in place, after the
# destinations before it were written (store_kv: K before V; copy_slots: cache by cache).
UNWRITABLE = {
    "store_kv": lambda kc, vc: K.store_kv(kc, vc, torch.tensor([1, 2]), torch.ones(2, 2, 4), torch.ones(2, 2, 4)),
    "copy_slots": lambda kc, vc: K.copy_slots([kc, vc], torch.tensor([1]), torch.tensor([2])),
    "gather_kv out": lambda kc, vc: K.gather_kv(_caches()[0], _caches()[1], torch.tensor([1, 2]),
                                                out=(kc[:2], vc[:2])),
}


@pytest.mark.parametrize("make", [_inference, _grad_leaf], ids=["inference", "leaf-requiring-grad"])
@pytest.mark.parametrize("call", list(UNWRITABLE))
def test_a_destination_torch_cannot_write_is_refused_before_anything_is_written(call, make):
    # Was: K (or the first cache) written, then torch's untyped "Inplace update to inference
    # tensor outside InferenceMode" / "a leaf Variable that requires grad" on the next one.
    kc, vc = _caches()
    vc = make(vc)
    before = (kc.clone(), vc.detach().clone())
    with torch.enable_grad(), pytest.raises(K.KernelArgumentError, match="v_cache|caches\\[1\\]|out\\[1\\]"):
        UNWRITABLE[call](kc, vc)
    assert _unchanged(before, kc, vc.detach())


def test_the_same_destinations_are_written_where_torch_allows_it():
    kc, vc = _caches()
    with torch.inference_mode():
        inf = vc.clone()
        K.store_kv(kc, inf, torch.tensor([1]), torch.ones(1, 2, 4), torch.ones(1, 2, 4))
    leaf = _grad_leaf(vc)
    with torch.no_grad():
        K.store_kv(kc, leaf, torch.tensor([1]), torch.ones(1, 2, 4), torch.full((1, 2, 4), 2.0))
    assert bool((inf[1] == 1).all()) and bool((leaf[1] == 2).all())


def test_a_req_to_token_torch_cannot_write_is_refused():
    table = _inference(torch.zeros(4, 8, dtype=torch.int32))
    one = torch.tensor([1])
    with pytest.raises(K.KernelArgumentError, match="req_to_token is an inference tensor"):
        K.write_req_to_token(table, one, one, one, one)
    with pytest.raises(K.KernelArgumentError, match="req_to_token must be a dense 2-D"):
        K.write_req_to_token([[0] * 8] * 4, one, one, one, one)
    assert not table.any()


@pytest.mark.parametrize("where, layout", [
    ("cache", "sparse"), ("cache", "mkldnn"), ("rows", "sparse"), ("rows", "mkldnn"),
    ("slots", "sparse"),  # (mkldnn tensors are floating point only)
])
def test_tensors_of_another_layout_are_tensor_shape_errors(where, layout):
    kc, vc = _caches()
    args = {"cache": kc, "rows": torch.ones(1, 2, 4), "slots": torch.tensor([1])}
    args[where] = args[where].to_sparse() if layout == "sparse" else args[where].to_mkldnn()
    with pytest.raises(kvpool.TensorShapeError, match="dense"):
        K.store_kv(args["cache"], None, args["slots"], args["rows"])
    with pytest.raises(kvpool.TensorShapeError, match="dense"):
        K.gather_kv(args["cache"], None, args["slots"]) if where != "rows" else K.copy_slots(
            [kc, args["rows"]], args["slots"], args["slots"])


@pytest.mark.parametrize("out", [5, (torch.empty(1, 2, 4),), [torch.empty(1, 2, 4)] * 3, "ab"])
def test_gather_kv_out_that_is_not_a_pair_is_a_kernel_argument_error(out):
    kc, vc = _caches()
    with pytest.raises(K.KernelArgumentError, match=r"out must be a \(k_out, v_out\) pair"):
        K.gather_kv(kc, vc, torch.tensor([1]), out=out)


@pytest.mark.parametrize("slots", [[1, 2], np.array([1, 2])], ids=["list", "numpy"])
def test_kernels_take_index_tensors_only(slots):
    kc, vc = _caches()
    with pytest.raises(K.KernelArgumentError, match="slots must be a torch.Tensor"):
        K.store_kv(kc, vc, slots, torch.ones(2, 2, 4), torch.ones(2, 2, 4))


def test_duplicate_slots_store_one_of_the_rows():
    # Documented: which repeated row lands is unspecified (not refused by store_kv).
    kc, _ = _caches()
    rows = torch.stack([torch.full((2, 4), 1.0), torch.full((2, 4), 2.0)])
    K.store_kv(kc, None, torch.tensor([3, 3]), rows)
    assert torch.equal(kc[3], rows[0]) or torch.equal(kc[3], rows[1])


# ----- the Triton kernels in the interpreter, and the torch path, vs a naive loop -----

CHILD = textwrap.dedent(r"""
    import os, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    import kvpool, kvpool.kernels as K
    from kvpool.kernels import _ref
    assert K.INTERPRET
    F8 = torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(3)

    def bits(t):
        return t.contiguous().reshape(-1).view(torch.uint8)

    def same(a, b):
        return a.shape == b.shape and torch.equal(bits(a), bits(b))

    def at(cache, s):
        return cache[s] if cache.dim() == 3 else cache[s // cache.shape[1], s % cache.shape[1]]

    def naive_store(cache, slots, x, scale):
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                y = x[i].float() / (1.0 if scale is None else float(scale))
                at(cache, s).copy_(y.clamp(-448, 448).to(cache.dtype) if cache.dtype == F8 else y.to(cache.dtype))

    def garbage(shape, dtype):
        return torch.randint(-100, 100, shape, generator=gen).to(dtype)

    cases = 0
    for dt in (torch.float32, torch.float16, torch.bfloat16, F8):
        for pages, P, H, D, mla in ((6, 1, 1, 80, False), (3, 3, 2, 96, False), (2, 5, 1, 3, True)):
            S = pages * P
            shape = (S, H, D) if P == 1 else (pages, P, H, D)
            kc = garbage(shape, dt)
            vc = None if mla else garbage(shape, dt)
            slots = torch.tensor([S - 1, -1, 0, S // 2], dtype=torch.int32 if P == 3 else torch.int64)
            # Non-contiguous rows: a transpose and a stride-2 slice; values exact in every dtype.
            in_dt = torch.float16 if dt == F8 else dt
            k = (torch.randint(-8, 8, (H, 4, D), generator=gen) * 0.5).to(in_dt).transpose(0, 1)
            v = None if mla else (torch.randint(-8, 8, (4, H, 2 * D), generator=gen) * 0.25).to(in_dt)[:, :, ::2]
            scale = torch.tensor([2.0]) if dt == F8 else None
            want_k, want_v = kc.clone(), None if mla else vc.clone()
            naive_store(want_k, slots, k, scale)
            if not mla:
                naive_store(want_v, slots, v, scale)
            for store in (K.store_kv, _ref.store_kv_ref):  # interpreter kernel, torch CPU path
                gk, gv = kc.clone(), None if mla else vc.clone()
                store(gk, gv, slots, k, v, scale, None if mla else scale)
                assert same(gk, want_k), (store.__name__, dt, P, H, D)
                assert mla or same(gv, want_v), (store.__name__, dt, P, H, D)
            out_dt = in_dt if dt == F8 else None
            ik, iv = K.gather_kv(want_k, want_v, slots, out_dtype=out_dt, k_scale=scale, v_scale=scale)
            rk, rv = _ref.gather_kv_ref(want_k, want_v, slots, out_dt, scale, scale)
            assert same(ik, rk) and (mla or same(iv, rv)), ("gather", dt, P, H, D)
            assert not bits(ik[1]).any()
            if dt != F8:
                assert same(ik[0], k[0].to(dt)) and same(ik[2], k[2].to(dt))
            src, dst = torch.tensor([0, S - 1, -1]), torch.tensor([S - 1 - (S > 2), 1, 2])
            caches = [c.clone() for c in (want_k, want_v) if c is not None]
            refs = [c.clone() for c in caches]
            K.copy_slots(caches, src, dst)
            _ref.copy_slots_ref(refs, src, dst)
            assert all(same(a, b) for a, b in zip(caches, refs)), ("copy", dt, P, H, D)
            K.store_kv(kc, vc, slots[:0], k[:0], None if mla else v[:0], scale, None if mla else scale)
            cases += 1

    # Out-of-range slots are refused on the host before the interpreter touches memory
    # (was: a write past the buffer, then "corrupted double-linked list").
    kc = torch.zeros(8, 1, 4)
    for call in (lambda: K.store_kv(kc, None, torch.tensor([9]), torch.ones(1, 1, 4)),
                 lambda: K.gather_kv(kc, None, torch.tensor([1, 64])),
                 lambda: K.copy_slots([kc], torch.tensor([100]), torch.tensor([1]))):
        try:
            call()
        except kvpool.SlotRangeError:
            pass
        else:
            raise AssertionError("out-of-range slot accepted")
    assert not kc.any()
    table = torch.zeros(2, 4, dtype=torch.int32)
    one = torch.tensor([1])
    for args in ((torch.tensor([2]), one, one, one), (one, torch.tensor([-1]), one, one),
                 (one, torch.tensor([3]), torch.tensor([2]), torch.tensor([1, 2]))):
        try:
            K.write_req_to_token(table, *args)
        except kvpool.InvalidArgumentError:
            pass
        else:
            raise AssertionError("req_to_token span past the table accepted")
    assert not table.any()
    k = torch.ones(1, 1, 4, requires_grad=True)
    K.store_kv(kc, None, torch.tensor([2]), k)
    assert not kc.requires_grad and kc[2].eq(1).all()
    print("CASES", cases)
""")


def test_interpreter_and_torch_paths_match_a_naive_loop():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "CASES 12" in proc.stdout


# ----- DecodeGraphRunner on CPU --------------------------------------------------------

def _runner_pool():
    pool = kvpool.KVPool(1, 1, 8, dtype=torch.float32, device="cpu", num_pages=12, page_size=3,
                         max_requests=4, max_context_len=9)
    return pool


def test_runner_refuses_bad_steps_and_leaves_its_buffers_and_the_pool_unchanged():
    pool = _runner_pool()
    runner = DecodeGraphRunner(pool, lambda ids, pos, rows, loc, lens: ids.float()[:, None] * 2,
                               max_batch_size=6, buckets=[2, 6])
    S, null, ctx = pool.num_slots, pool.null_row, 9
    good = ([1, 2, 3], [0, 1, ctx - 1], [0, 1, null], [S - 1, -1, 0], [1, 2, ctx])
    assert runner.run(*good).tolist() == [[2.0], [4.0], [6.0]]  # bounds accepted; bucket 6 not captured
    static, caches = runner._static.clone(), [t.clone() for t in pool.k_buffers + pool.v_buffers]
    bad = [
        (3, [S, 1, 1], kvpool.SlotRangeError, rf"out_cache_loc\[0\] = {S}"),
        (3, np.array([1, 2**64 - 1, 1], dtype=np.uint64), kvpool.SlotRangeError, "out_cache_loc"),
        (2, [0, null + 1, 0], kvpool.InvalidArgumentError, rf"req_rows\[1\] = {null + 1}"),
        (2, [-1, 0, 0], kvpool.InvalidArgumentError, r"req_rows\[0\] = -1"),
        (1, [0, ctx, 0], kvpool.InvalidArgumentError, rf"positions\[1\] = {ctx}"),
        (4, [1, ctx + 1, 1], kvpool.InvalidArgumentError, rf"seq_lens\[1\] = {ctx + 1}"),
        (0, [1, -2, 1], kvpool.InvalidArgumentError, r"input_ids\[1\] = -2"),
        (3, torch.tensor([1.0, 2.0, 3.0]), kvpool.TensorDtypeError, "must be integers"),
        (3, [[1], [2], [3]], kvpool.TensorShapeError, "1-D"),
        (0, torch.tensor([1, 2, 3]).to_sparse(), kvpool.TensorShapeError, "input_ids is a torch.sparse_coo"),
    ]
    for i, value, err, match in bad:
        args = list(good)
        args[i] = value
        with pytest.raises(err, match=match):
            runner.run(*args)
        assert torch.equal(runner._static, static)
        assert _unchanged(caches, *(pool.k_buffers + pool.v_buffers))
    with pytest.raises(kvpool.InvalidArgumentError, match="exceeds max_batch_size 6"):
        runner.run(*([0] * 7 for _ in range(5)))
    assert torch.equal(runner._static, static)


@pytest.mark.parametrize("rows,starts,counts,nslots,err,match", [
    ([4], [0], [1], 1, K.KernelArgumentError, r"rows\[0\] = 4 .*\[0, 4\)"),
    ([1], [7], [2], 2, K.KernelArgumentError, r"starts\[0\] \+ counts\[0\] = 9 .*8 columns"),
    ([1], [-1], [1], 1, K.KernelArgumentError, r"starts\[0\] = -1"),
    ([0, 1], [0, 0], [2, 2], 3, kvpool.TensorShapeError, "slots has 3 entries, the counts need 4"),
    # int64 spans whose start + count wraps negative (and counts whose sum wraps to 0 or 1)
    # passed: an untyped RuntimeError from repeat_interleave, or nothing written for [2**62] * 4.
    ([0] * 4, [2**62] * 4, [2**62] * 4, 1, K.KernelArgumentError, r"starts\[0\] \+ counts\[0\] = 9223372036854775808"),
    ([0, 0, 1], [1, 1, 0], [2**63 - 1, 2**63 - 1, 3], 3, K.KernelArgumentError, "= 9223372036854775808 is outside"),
    ([-1, -1, 0], [0, 0, 0], [2**63 - 1, 2**63 - 1, 3], 3, kvpool.TensorShapeError,
     "slots has 3 entries, the counts need 9223372036854775807"),
    # No slots at all for positive counts: returned before the check, writing nothing silently.
    ([0], [0], [3], 0, kvpool.TensorShapeError, "slots has 0 entries, the counts need 3"),
    ([-1, 2], [0, 0], [2, 0], 0, kvpool.TensorShapeError, "slots has 0 entries, the counts need 2"),
])
def test_write_req_to_token_host_values_past_the_table_are_refused(rows, starts, counts, nslots, err, match):
    # Was: IndexError (or a broadcast of too few slots) from index_put_, and past-the-table
    # writes under the interpreter. Negative rows and counts <= 0 stay skipped.
    table = torch.zeros(4, 8, dtype=torch.int32)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    with pytest.raises(err, match=match):
        K.write_req_to_token(table, t(rows), t(starts), t(counts), torch.arange(5, 5 + nslots))
    assert not table.any()
    K.write_req_to_token(table, t([-1, 3, 2]), t([99, 6, 0]), t([1, 2, 0]), t([7, 8, 9]))
    assert table[3, 6:].tolist() == [8, 9] and table.sum() == 17


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), -0.5])
def test_non_finite_or_non_positive_float_scales_are_refused(scale):
    # Was (inf): accepted, every stored row became 0 and every gathered one inf/NaN.
    kc, vc = _caches()
    before = kc.clone()
    with pytest.raises(K.KernelArgumentError, match="k_scale must be > 0 and finite"):
        K.store_kv(kc, None, torch.tensor([1]), torch.ones(1, 2, 4), k_scale=scale)
    with pytest.raises(K.KernelArgumentError, match="k_scale must be > 0 and finite"):
        K.gather_kv(kc, None, torch.tensor([1]), k_scale=scale)
    assert torch.equal(kc, before)


def test_store_kv_of_rows_that_are_views_of_the_caches_on_the_torch_path():
    # Was: K stored, then RuntimeError from index_copy_ on V (source overlaps the
    # destination). Now stored as the rows were when the call was made, as KVPool.write does.
    kc, vc = _caches()
    k0, v0 = kc.clone(), vc.clone()
    K.store_kv(kc, vc, torch.tensor([0, 5]), kc[1:3], vc[0:2])
    assert torch.equal(kc[0], k0[1]) and torch.equal(kc[5], k0[2])
    assert torch.equal(vc[0], v0[0]) and torch.equal(vc[5], v0[1])
    K.store_kv(kc, None, torch.tensor([2, 1]), kc[1:3])  # a swap: the old rows, not the new ones
    assert torch.equal(kc[2], k0[1]) and torch.equal(kc[1], k0[2])


def test_gather_kv_without_v_cache_takes_no_v_out():
    # Was: the caller's v_out came back untouched as "v", where the docstring says None.
    kc, _ = _caches()
    with pytest.raises(K.KernelArgumentError, match=r"out\[1\] must be None without v_cache"):
        K.gather_kv(kc, None, torch.tensor([1]), out=(torch.empty(1, 2, 4), torch.full((1, 2, 4), 7.0)))


def test_negative_bit_caches_and_outputs_are_refused_on_both_backends():
    """A cache or gather output that is a negative-bit view (``z.conj().imag``): torch's ops
    negate through the bit, the kernels' raw writes and reads do not, so the two backends
    disagreed; both refuse it now, before anything is written."""
    neg = torch.complex(torch.zeros(8, 1, 4), torch.ones(8, 1, 4)).conj().imag
    assert neg.is_neg()
    before = neg.resolve_neg()
    with pytest.raises(K.KernelArgumentError, match="negative-bit"):
        K.store_kv(neg, None, torch.tensor([1]), torch.ones(1, 1, 4))
    with pytest.raises(K.KernelArgumentError, match="negative-bit"):
        K.gather_kv(neg, None, torch.tensor([1]))
    with pytest.raises(K.KernelArgumentError, match="negative-bit"):
        K.copy_slots([neg], torch.tensor([1]), torch.tensor([2]))
    assert torch.equal(neg.resolve_neg(), before)
    out = torch.complex(torch.zeros(1, 1, 4), torch.ones(1, 1, 4)).conj().imag
    with pytest.raises(K.KernelArgumentError, match="out\\[0\\] must be"):
        K.gather_kv(torch.zeros(8, 1, 4), None, torch.tensor([1]), out=(out, None))


def test_a_negative_bit_scale_tensor_is_refused_on_both_backends():
    """A 1-element scale tensor that is a negative-bit view (its memory holds -2 for a scale
    of 2): the kernels read the scale from memory at launch, so store_kv stored x / -2 and
    gather_kv multiplied by -2 (under the interpreter and on CUDA), where torch's path used 2."""
    scale = torch.complex(torch.zeros(1), torch.full((1,), -2.0)).conj().imag
    assert scale.is_neg() and float(scale) == 2.0
    kc, vc = _caches()
    before = kc.clone()
    with pytest.raises(K.KernelArgumentError, match="k_scale is a negative-bit view"):
        K.store_kv(kc, None, torch.tensor([1]), torch.ones(1, 2, 4), k_scale=scale)
    with pytest.raises(K.KernelArgumentError, match="v_scale is a negative-bit view"):
        K.store_kv(kc, vc, torch.tensor([1]), torch.ones(1, 2, 4), torch.ones(1, 2, 4), v_scale=scale)
    assert torch.equal(kc, before)
    with pytest.raises(K.KernelArgumentError, match="k_scale is a negative-bit view"):
        K.gather_kv(kc, None, torch.tensor([1]), k_scale=scale)
    K.store_kv(kc, None, torch.tensor([1]), torch.ones(1, 2, 4), k_scale=scale.resolve_neg())
    assert torch.equal(kc[1], torch.full((2, 4), 0.5))
