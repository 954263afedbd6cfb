"""KVPool.write (plain and hybrid) with sources an outside caller may hand it: K/V that are
views of the pool's own caches, and tensors of a non-dense layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
from kvpool.errors import KVPoolError, LayerIndexError, TensorShapeError

H, D = 2, 4


def plain() -> tuple[kvpool.KVPool, np.ndarray]:
    pool = kvpool.KVPool(2, H, D, dtype=torch.float16, num_pages=8, page_size=2, max_requests=3,
                         max_context_len=8)
    h = pool.open(1)
    slots = pool.extend(h, 6).slots
    torch.manual_seed(0)
    for layer in range(2):
        pool.write(layer, slots, torch.randn(6, H, D).half(), torch.randn(6, H, D).half())
    return pool, slots


def hybrid() -> tuple[kvpool.KVPool, np.ndarray]:
    pool = kvpool.KVPool(2, H, D, layer_types=["full_attention", "sliding_attention"], sliding_window=4,
                         dtype=torch.float16, num_pages=8, page_size=2, max_requests=3, max_context_len=8)
    h = pool.open(1)
    res = pool.extend(h, 6)
    slots = res.for_layer(0).numpy()
    torch.manual_seed(0)
    pool.write(0, slots, torch.randn(6, H, D).half(), torch.randn(6, H, D).half())
    return pool, slots


def snapshot(pool) -> list[bytes]:
    return [t.contiguous().view(torch.uint8).numpy().tobytes() for _, t in pool.named_tensors()]


@pytest.mark.parametrize("make", [plain, hybrid])
@pytest.mark.parametrize("which", ["k", "v", "both"])
def test_rows_that_are_views_of_the_caches_are_stored_as_they_were(make, which):
    """Moving rows within a layer by passing views of its own caches (overlapping the
    destination rows) stores the values the views held when the call was made."""
    pool, slots = make()
    src, dst = slots[1:4], slots[2:5]  # overlapping: dst[i] == src[i + 1]
    kb, vb = pool.k_buffer(0), pool.v_buffer(0)
    lo, hi = int(src[0]), int(src[-1]) + 1
    assert hi - lo == 3  # one request on a fresh pool: consecutive slots
    k_new, v_new = torch.randn(3, H, D).half(), torch.randn(3, H, D).half()
    k = kb[lo:hi] if which in ("k", "both") else k_new
    v = vb[lo:hi] if which in ("v", "both") else v_new
    want_k, want_v = k.clone(), v.clone()
    pool.write(0, dst, k, v)
    got_k, got_v = pool.read(0, dst)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("make", [plain, hybrid])
@pytest.mark.parametrize("which", ["k", "v"])
def test_sparse_rows_are_a_typed_error_and_change_nothing(make, which):
    pool, slots = make()
    dense = torch.ones(2, H, D).half()
    sparse = torch.ones(2, H, D).to_sparse().half()
    k, v = (sparse, dense) if which == "k" else (dense, sparse)
    before = snapshot(pool)
    with pytest.raises(KVPoolError) as info:
        pool.write(0, slots[:2], k, v)
    assert type(info.value) is TensorShapeError
    assert "strided" in str(info.value) and which in str(info.value)
    assert snapshot(pool) == before


@pytest.mark.parametrize("layer", [2, -1, 7])
def test_hybrid_extend_result_for_a_layer_outside_the_pool_is_a_layer_index_error(layer):
    pool, _ = hybrid()
    res = pool.extend(pool.open(1), 2)
    with pytest.raises(LayerIndexError, match=r"\[0, 2\)"):
        res.for_layer(layer)


@pytest.mark.parametrize("make", [plain, hybrid])
@pytest.mark.parametrize("which", ["k", "v"])
def test_rows_that_are_views_of_the_caches_are_stored_as_they_were_under_torch_compile(make, which):
    # Dynamo traced the refused index_copy_ into its graph, where the clone-and-retry never ran
    # ("some elements ... refer to a single memory location"); with only V a view, K was stored.
    pool, slots = make()
    src, dst = slots[1:4], slots[2:5]
    lo, hi = int(src[0]), int(src[-1]) + 1
    kb, vb = pool.k_buffer(0), pool.v_buffer(0)
    k = kb[lo:hi] if which == "k" else torch.randn(3, H, D).half()
    v = vb[lo:hi] if which == "v" else torch.randn(3, H, D).half()
    want_k, want_v = k.clone(), v.clone()
    dst_t = torch.as_tensor(np.ascontiguousarray(dst))
    torch._dynamo.reset()
    torch.compile(lambda kk, vv: pool.write(0, dst_t, kk, vv), backend="eager")(k, v)
    got_k, got_v = pool.read(0, dst)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("make", [plain, hybrid])
def test_rows_without_storage_are_a_typed_error_before_k_is_stored(make):
    # V batched by vmap (K plain): torch refused V's copy after K's went through, and the
    # retry path raised its own untyped error reading V's storage.
    pool, slots = make()
    before = snapshot(pool)
    k = torch.randn(2, H, D).half()

    def write(v):
        pool.write(0, slots[:2], k, v)
        return v

    with pytest.raises(kvpool.TensorDeviceError, match="no storage kvpool can copy from"):
        torch.func.vmap(write, in_dims=0)(torch.randn(1, 2, H, D).half())
    assert snapshot(pool) == before


# ----- engine-made slot arrays: read-only ones --------------------------------
# Slots received as bytes (np.frombuffer) or through shared memory are read-only numpy
# arrays. write/read handed them to torch.from_numpy, which printed a UserWarning about
# non-writable arrays (once per process), though the pool never writes the slots.


def test_read_only_slot_arrays_write_and_read_without_a_warning() -> None:
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    code = textwrap.dedent("""
        import numpy as np, torch
        from kvpool import KVPool
        pool = KVPool(1, 1, 2, num_slots=32, max_requests=4, max_context_len=16)
        h = pool.open(1)
        got = pool.extend(h, 3).slots
        for slots in (np.frombuffer(got.astype(np.int64).tobytes(), dtype=np.int64),
                      np.frombuffer(got.astype(np.int32).tobytes(), dtype=np.int32)):
            assert not slots.flags.writeable
            k = torch.randn(3, 1, 2).half()
            pool.write(0, slots, k, -k)
            rk, rv = pool.read(0, slots)
            assert torch.equal(rk, k) and torch.equal(rv, -k)
        pool.check()
        print("done")
    """)
    import os

    import kvpool

    # The package this run imports (the installed one in CI, where the checkout's python/
    # has no built _core).
    src = str(Path(kvpool.__file__).resolve().parents[1])

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), src) if p))
    out = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "done"
