"""Outside check of the plain torch ``KVPool``'s K/V integrity on CPU (page sizes 1, 3, 16).

A seeded random driver keeps a plain reference: per live request, the value written at every
position (every write is a fresh value, so a copy-on-write done in place, or a page handed to
two requests, shows even when both wrote the same tokens). A prefix hit may serve any value
ever written for exactly that (salt, token prefix); the reference checks that and adopts it.
The trace opens (plain, with a prefix, ``admit``), extends one or several requests in one call
and writes their rows in every form ``write`` takes (the pool's own tensor, numpy, lists, int32,
strided slots, padding and page-0 rows, permuted, split, non-contiguous rows, rows that require
grad), forks, truncates (into registered pages, to 0), caches, closes, evicts, and runs out of
pages. After every step each live request reads back through every read path: ``read``, the
layer views in the pool's layout, ``caches``, ``kernels.gather_kv``, its ``req_to_token`` row
and the FlashInfer page table. The same traces run under each grad mode and from two threads
on one pool. Bad calls raise kvpool's typed errors and change nothing (stats, tables, bytes).
Hybrid pools, tiers, the page-1 machine and the kernels have their own review files.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np
import pytest
import torch
from review_kv_trace import BASE, MAX_CTX, MAX_REQ, PAGES, D, H, L, Seen, Trace, counter, make_pool, run_trace

import kvpool
from kvpool import KVPoolError


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize(("seed", "layout", "device_tables"),
                         [(0, "token", False), (0, "paged", True), (1, "paged", False), (1, "token", True)])
def test_random_traces_read_back_what_was_written(page_size, seed, layout, device_tables):
    run_trace(seed * 100 + page_size, page_size, layout, 60, device_tables)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_traces_without_sharing_rewrite_registered_pages_in_place(page_size):
    """No prefix hit or fork until the end, so extend takes its path without copy-on-write
    work; admit with token ids and cache register pages that truncates then cut into."""
    run_trace(3 + page_size, page_size, "token", 50, sharing=False)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "mla", "fp8-mla"])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_random_traces_of_other_dtypes_and_mla(kind, page_size):
    """fp8 with per-layer scales other than 1 (each layer's own, K's and V's apart): the
    digits stay exact in e4m3 when divided and multiplied back."""
    run_trace(5 + page_size, page_size, "paged" if page_size == 3 else "token", 40, page_size == 16, kind=kind,
              scales=([2.0, 0.5], [4.0, 0.25]) if kind.startswith("fp8") else None)


MODES = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize(("mode", "pool_mode"), [("grad", "inference_mode"), ("no_grad", "grad"),
                                                 ("inference_mode", "grad"), ("inference_mode", "no_grad")])
@pytest.mark.parametrize("page_size", [1, 16])
def test_random_traces_under_each_grad_mode(mode, pool_mode, page_size):
    """Driven in one mode on a pool built in another: rows that require grad, inference
    tensors as rows; the pool's tensors stay normal tensors out of autograd."""
    with MODES[mode]():
        t = run_trace(7 + page_size, page_size, "paged" if page_size > 1 else "token", 40,
                      page_size == 16, MODES[pool_mode])
    for name, x in t.p.named_tensors():
        assert not x.is_inference() and not x.requires_grad, name


def _bad_calls(t, h, c, n):
    """(name, expected error, call) for a pool with live request ``h`` (length ``n`` > 0) and
    closed handle ``c``."""
    p, P = t.p, t.P
    good = torch.from_numpy(p.slots(h))
    k, v = t.rows(list(range(1, n + 1)), 0)
    E = kvpool
    meta = torch.empty((n, H, D), dtype=t.cdt, device="meta")
    return [
        ("rows of another dtype", E.TensorDtypeError, lambda: p.write(0, good, k.half(), v.half())),
        ("v of another dtype", E.TensorDtypeError, lambda: p.write(0, good, k, v.double())),
        ("rows of other heads", E.TensorShapeError, lambda: p.write(0, good, k[:, :1], v[:, :1])),
        ("one row short", E.TensorShapeError, lambda: p.write(0, good, k[:-1], v[:-1])),
        ("an extra dim", E.TensorShapeError, lambda: p.write(0, good, k[..., None], v[..., None])),
        ("rows on meta", E.TensorDeviceError, lambda: p.write(0, good, meta, meta)),
        ("rows a list", E.TensorDtypeError, lambda: p.write(0, good, k.tolist(), v)),
        ("sparse rows", E.TensorShapeError, lambda: p.write(0, good, k.to_sparse(), v)),
        ("no v", E.TensorShapeError, lambda: p.write(0, good, k)),
        ("last slot past the pool", E.SlotRangeError,
         lambda: p.write(0, torch.cat([good[:-1], torch.tensor([p.num_slots])]), k, v)),
        ("slot past the pool in a list", E.SlotRangeError,
         lambda: p.write(1, good.tolist()[:-1] + [p.num_slots + 5], k, v)),
        ("int32 slot past the pool", E.SlotRangeError,
         lambda: p.write(0, torch.cat([good[:-1], torch.tensor([p.num_slots])]).int(), k, v)),
        ("slot 2**63 in a list", E.SlotRangeError, lambda: p.write(0, good.tolist()[:-1] + [2**63], k, v)),
        ("uint64 slot past int64", E.SlotRangeError,
         lambda: p.write(0, np.array(good.tolist()[:-1] + [2**64 - 1], dtype=np.uint64), k, v)),
        ("float slots", E.TensorDtypeError, lambda: p.write(0, good.float(), k, v)),
        ("int16 slots", E.TensorDtypeError, lambda: p.write(0, good.short(), k, v)),
        ("2-D slots", E.TensorShapeError, lambda: p.write(0, good.view(1, -1), k[None], v[None])),
        ("strict page-0 slot", E.ReservedSlotError,
         lambda: p.write(0, torch.cat([good[:-1], torch.tensor([P - 1])]), k, v, strict=True)),
        ("strict negative slot", E.ReservedSlotError,
         lambda: p.write(0, torch.cat([good[:-1], torch.tensor([-1])]), k, v, strict=True)),
        ("strict repeated slot", E.DuplicateSlotError,
         lambda: p.write(0, torch.cat([good[:1], good[:-1]]), k, v, strict=True)),
        ("strict not a bool", E.InvalidArgumentError, lambda: p.write(0, good, k, v, strict=1)),
        ("layer past the pool", E.LayerIndexError, lambda: p.write(L, good, k, v)),
        ("negative layer", E.LayerIndexError, lambda: p.write(-1, good, k, v)),
        ("bool layer", E.LayerIndexError, lambda: p.write(True, good, k, v)),
        ("read past the pool", E.SlotRangeError, lambda: p.read(0, [p.num_slots])),
        ("extend a closed handle", E.InvalidHandleError, lambda: p.extend([c], [1])),
        ("extend a live and a closed handle", E.InvalidHandleError, lambda: p.extend([h, c], [1, 1])),
        ("extend a handle twice", E.InvalidArgumentError, lambda: p.extend([h, h], [1, 1])),
        ("extend by -1", E.InvalidArgumentError, lambda: p.extend([h], [-1])),
        ("extend past max_context_len", E.ContextTooLongError, lambda: p.extend([h], [MAX_CTX - n + 1])),
        ("extend with a token short", E.InvalidArgumentError, lambda: p.extend([h], [2], tokens=[1])),
        ("extend with a negative token", E.InvalidArgumentError, lambda: p.extend([h], [1], tokens=[-3])),
        ("extend with counts of another length", E.InvalidArgumentError, lambda: p.extend([h], [1, 1])),
        ("extend by a bool", E.InvalidArgumentError, lambda: p.extend([h], True)),
        ("extend a float handle", E.InvalidArgumentError, lambda: p.extend([float(h)], [1])),
        ("truncate past the length", E.InvalidArgumentError, lambda: p.truncate([h], [n + 1])),
        ("truncate to -1", E.InvalidArgumentError, lambda: p.truncate([h], [-1])),
        ("truncate a closed handle", E.InvalidHandleError, lambda: p.truncate([c], [0])),
        ("truncate a live and a closed handle", E.InvalidHandleError, lambda: p.truncate([h, c], [0, 0])),
        ("fork a closed handle", E.InvalidHandleError, lambda: p.fork(c, 1)),
        ("fork too many", E.TooManyRequestsError, lambda: p.fork(h, MAX_REQ)),
        ("fork -1", E.InvalidArgumentError, lambda: p.fork(h, -1)),
        ("close a closed handle", E.InvalidHandleError, lambda: p.close([c])),
        ("close a live and a closed handle", E.InvalidHandleError, lambda: p.close([h, c], cache=True)),
        ("close a handle twice", E.InvalidArgumentError, lambda: p.close([h, h])),
        ("cache a closed handle", E.InvalidHandleError, lambda: p.cache([h, c])),
        ("page_table of a closed handle", E.InvalidHandleError, lambda: p.page_table([h, c])),
        ("open prompts of other lengths", E.InvalidArgumentError, lambda: p.open_with_prefix([1, 2, 3], [2])),
        ("open a negative token", E.InvalidArgumentError, lambda: p.open_with_prefix([1, -2], [2])),
        ("open too many", E.TooManyRequestsError, lambda: p.open_with_prefix([1] * MAX_REQ, [1] * MAX_REQ)),
        ("admit a negative count", E.InvalidArgumentError, lambda: p.admit([2, -1])),
        ("admit past max_context_len", E.ContextTooLongError, lambda: p.admit([1, MAX_CTX + 1])),
        ("admit too many", E.TooManyRequestsError, lambda: p.admit([1] * MAX_REQ)),
        ("admit more than the pool", E.PoolExhaustedError, lambda: p.admit([MAX_CTX, MAX_CTX])),
        ("open -1", E.InvalidArgumentError, lambda: p.open(-1)),
        ("evict -1", E.InvalidArgumentError, lambda: p.evict(-1)),
    ]


@pytest.mark.parametrize(("page_size", "kind"), [(1, "f32"), (3, "fp8"), (16, "bf16")])
def test_bad_calls_raise_typed_errors_and_change_nothing(page_size, kind):
    t = run_trace(40 + page_size, page_size, "paged", 25, kind=kind)
    p, rng = t.p, t.rng
    while len(t.reqs) > MAX_REQ - 3:
        h = sorted(t.reqs)[0]
        p.close([h])
        del t.reqs[h]
        t.closed.append(h)
    p.evict(p.num_pages)  # room for the prefill
    (h,) = t.open_prompts([BASE[:5]], None)
    t.closed.append(int(p.open(1)[0]))
    p.close([t.closed[-1]])
    n = p.length(h)
    wrong = []
    for name, err, call in _bad_calls(t, h, t.closed[-1], n):
        before = t.snapshot()
        try:
            call()
        except KVPoolError as e:
            if not isinstance(e, err):
                wrong.append(f"{name}: {type(e).__name__} ({e}), not {err.__name__}")
            elif len(str(e)) < 20:
                wrong.append(f"{name}: an unclear message {e!r}")
        except Exception as e:  # noqa: BLE001 - every other error is a finding
            wrong.append(f"{name}: untyped {type(e).__name__}: {e}")
        else:
            wrong.append(f"{name}: no error")
        try:
            t.same(before, name)
        except AssertionError as e:
            wrong.append(str(e).splitlines()[0])
        t.verify()
        rng.integers(0, 2)
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("page_size", "device_tables", "second_shares"), [(3, False, True), (16, True, True),
                                                                          (1, False, False), (3, True, False)])
def test_two_threads_on_one_pool_each_read_back_their_own(page_size, device_tables, second_shares):
    """Two drivers, each on its own requests of one pool (one under inference_mode, one under
    no_grad), sharing a salt so that each hits the other's cached pages and copy-on-write
    copies read pages the other thread frees. Or one driver never shares, so the pool turns
    on copy-on-write (its first prefix hit or fork) while the other thread extends."""
    p = make_pool(page_size, "paged", num_pages=2 * PAGES[page_size], device_tables=device_tables)
    seen, vals, errors = Seen(), counter(), []

    def drive(seed, mode):
        t = Trace(np.random.default_rng(seed), p, seen, vals, salts=(None,), cap=MAX_REQ // 2, solo=False,
                  sharing=seed == 1 or second_shares)
        try:
            with mode():
                for _ in range(70):
                    t.step()
                    t.verify()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=drive, args=(s, m)) for s, m in ((1, torch.inference_mode), (2, torch.no_grad))]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    if errors:
        raise errors[0]
    p.check()


@pytest.mark.parametrize("slots", [[True, 3], (2, False), [np.True_, 3], [torch.tensor(True), 3], [np.array(True), 3]])
@pytest.mark.parametrize("call", ["write", "read"])
def test_a_bool_among_list_slots_is_refused_as_the_allocator_refuses_it(slots, call):
    """numpy turns ``[True, 3]`` into ints: at page size 1 the bool would name slot 1, a page a
    request holds, and its row would overwrite that request's K/V. The allocator refuses bools
    in its int lists; ``write`` / ``read`` refuse them too, before anything is written."""
    p = make_pool(1, "token")
    h = int(p.open(1)[0])
    res = p.extend([h], [3])  # slots 1, 2, 3
    t = Trace(np.random.default_rng(0), p, defaultdict(set), counter())
    k, v = t.rows([1, 2, 3], 0)
    p.write(0, res.slots, k, v)
    before = p.read(0, res.slots)
    with pytest.raises(kvpool.TensorDtypeError, match="bool"):
        if call == "write":
            p.write(0, slots, *t.rows([7, 8], 0))
        else:
            p.read(0, slots)
    after = p.read(0, res.slots)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
