"""Whole-page transfers (kvpool.kernels.offload_pages / load_pages) on CPU: bitwise round
trips device page -> host page -> another device page for every cache dtype, MLA, both
layouts, page sizes 1 and 16 and both methods; stray writes, per-layer runs, and every
argument error leaving caches and host storage bitwise unchanged.

The same tests run a second time in a child process with TRITON_INTERPRET=1 set before
kvpool is imported, so the "kernel" method goes through the Triton kernel itself
(test_through_the_triton_interpreter)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch

import kvpool
from kvpool.errors import (
    DuplicateSlotError,
    KernelArgumentError,
    LayerIndexError,
    ReservedSlotError,
    SlotRangeError,
    TensorDeviceError,
    TensorDtypeError,
    TensorShapeError,
)
from kvpool.kernels import _common, load_pages, offload_pages
from kvpool.tiers import HostStorage

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
METHODS = ["kernel", "copy"]
LAYERS = 3


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def make(dtype, layout="token", page_size=4, mla=False, num_pages=8, host_pages=6, seed=0):
    """A pool whose caches and a host storage hold random bytes (NaN and inf included),
    so any stray or missing write shows in a bitwise comparison."""
    if mla:
        pool = kvpool.KVPool(LAYERS, 1, 24, kv_lora_rank=16, qk_rope_head_dim=8, dtype=dtype, page_size=page_size,
                             num_pages=num_pages, layout=layout, max_requests=4, max_context_len=64)
    else:
        pool = kvpool.KVPool(LAYERS, 2, 8, dtype=dtype, page_size=page_size, num_pages=num_pages, layout=layout,
                             max_requests=4, max_context_len=64)
    host = HostStorage.for_pool(pool, host_pages=host_pages)
    gen = torch.Generator().manual_seed(seed)
    for t in pool._storage.caches + [host.buffer]:
        bits(t).copy_(torch.randint(0, 256, (bits(t).numel(),), dtype=torch.uint8, generator=gen))
    return pool, host


def page_view(pool, cache: int, layer: int, page: int) -> torch.Tensor:
    """One page of one layer through the pool's own layout views (k_buffer / v_buffer / kv_buffer)."""
    buf = pool.kv_buffer(layer) if pool.mla else (pool.k_buffer(layer) if cache == 0 else pool.v_buffer(layer))
    p = pool.page_size
    return buf[page] if pool.layout == "paged" else buf[page * p : (page + 1) * p]


def device_page(pool, page: int) -> torch.Tensor:
    """[C, L, P, H, D] of one device page, read through the layout views."""
    nc = 1 if pool.mla else 2
    return torch.stack([torch.stack([page_view(pool, c, layer, page) for layer in range(LAYERS)]) for c in range(nc)])


def snapshot(pool, host):
    return [bits(t).clone() for t in pool._storage.caches], bits(host.buffer).clone()


def unchanged(pool, host, snap) -> bool:
    caches, h = snap
    return all(torch.equal(bits(t), b) for t, b in zip(pool._storage.caches, caches)) and torch.equal(
        bits(host.buffer), h)


def test_backend_in_use():
    """Under TRITON_INTERPRET=1 the kernel method must run the Triton kernel on CPU tensors."""
    assert _common.use_triton(torch.zeros(1)) == (INTERPRETED and _common.INTERPRET)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["token", "paged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mla", [False, True], ids=["kv", "mla"])
def test_round_trip_is_bitwise(dtype, layout, page_size, method, mla):
    pool, host = make(dtype, layout, page_size, mla)
    before = {p: device_page(pool, p).clone() for p in range(pool.num_pages)}
    host_before = host.buffer.clone()
    offload_pages(pool._storage.caches, host, np.array([2, 5]), np.array([3, 1]), method=method)
    assert torch.equal(bits(host.buffer[3]), bits(before[2])) and torch.equal(bits(host.buffer[1]), bits(before[5]))
    for h in (0, 2, 4, 5):  # host pages not named stay as they were
        assert torch.equal(bits(host.buffer[h]), bits(host_before[h])), h
    for p in range(pool.num_pages):  # an offload writes nothing on the device
        assert torch.equal(bits(device_page(pool, p)), bits(before[p])), p

    load_pages(host, pool._storage.caches, [3, 1], [6, 4], method=method)
    for p in range(pool.num_pages):
        want = {6: before[2], 4: before[5]}.get(p, before[p])
        assert torch.equal(bits(device_page(pool, p)), bits(want)), p


@pytest.mark.parametrize("method", METHODS)
def test_reads_back_through_the_pool(method):
    """What KVPool.write stored and read returns survives offload -> load into other pages."""
    pool, host = make(torch.bfloat16, "token", 4)
    gen = torch.Generator().manual_seed(3)
    slots = np.arange(8, 16)  # pages 2 and 3
    rows = {}
    for layer in range(LAYERS):
        k = torch.randn(8, 2, 8, generator=gen).bfloat16()
        v = torch.randn(8, 2, 8, generator=gen).bfloat16()
        pool.write(layer, slots, k, v)
        rows[layer] = (k, v)
    offload_pages(pool._storage.caches, host, [2, 3], [4, 5], method=method)
    load_pages(host, pool._storage.caches, [4, 5], [6, 7], method=method)
    for layer in range(LAYERS):
        k, v = pool.read(layer, np.arange(24, 32))
        assert torch.equal(k, rows[layer][0]) and torch.equal(v, rows[layer][1])


@pytest.mark.parametrize("method", METHODS)
def test_layer_by_layer_equals_all_layers(method):
    pool, host = make(torch.float16, "paged", 4)
    whole_pool, whole_host = make(torch.float16, "paged", 4)
    for layer in range(LAYERS):
        offload_pages(pool._storage.caches, host, [1, 7], [2, 5], layers=layer, method=method)
    offload_pages(whole_pool._storage.caches, whole_host, [1, 7], [2, 5], method=method)
    assert torch.equal(bits(host.buffer), bits(whole_host.buffer))
    load_pages(host, pool._storage.caches, [2, 5], [3, 4], layers=range(0, 2), method=method)
    load_pages(host, pool._storage.caches, [2, 5], [3, 4], layers=slice(2, 3), method=method)
    load_pages(whole_host, whole_pool._storage.caches, [2, 5], [3, 4], method=method)
    for a, b in zip(pool._storage.caches, whole_pool._storage.caches):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("method", METHODS)
def test_a_repeated_source_fills_both_destinations(method):
    pool, host = make(torch.bfloat16)
    offload_pages(pool._storage.caches, host, [3, 3], [1, 2], method=method)
    assert torch.equal(bits(host.buffer[1]), bits(host.buffer[2]))
    assert torch.equal(bits(host.buffer[1]), bits(device_page(pool, 3)))


@pytest.mark.parametrize("method", METHODS)
def test_empty_batches_do_nothing(method):
    pool, host = make(torch.bfloat16)
    snap = snapshot(pool, host)
    offload_pages(pool._storage.caches, host, [], np.zeros(0, np.int64), method=method)
    load_pages(host, pool._storage.caches, torch.zeros(0, dtype=torch.int64), [], method=method)
    assert unchanged(pool, host, snap)


BAD_IDS = [
    # (device_pages, host_pages, error) for an offload
    ([0, 2], [1, 2], ReservedSlotError),  # device page 0
    ([1, 2], [0, 2], ReservedSlotError),  # host page 0
    ([1, 8], [1, 2], SlotRangeError),  # past the device's pages
    ([1, -1], [1, 2], SlotRangeError),
    ([1, 2], [1, 6], SlotRangeError),  # past the host's pages
    ([1, 2], [3, 3], DuplicateSlotError),  # one host page written twice
    ([1, 2], [3], TensorShapeError),
    ([1.0, 2.0], [1, 2], TensorDtypeError),
    ([[1, 2]], [[1, 2]], TensorDtypeError),
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dev,hst,err", BAD_IDS)
def test_bad_page_ids_are_refused_and_nothing_is_written(dev, hst, err, method):
    pool, host = make(torch.bfloat16)
    snap = snapshot(pool, host)
    with pytest.raises(err):
        offload_pages(pool._storage.caches, host, dev, hst, method=method)
    with pytest.raises(err if err is not DuplicateSlotError else DuplicateSlotError):
        # the same ids as a load: the duplicate is now a device destination
        load_pages(host, pool._storage.caches, hst, dev if err is not DuplicateSlotError else [3, 3], method=method)
    assert unchanged(pool, host, snap)


@pytest.mark.parametrize("ids", [
    torch.tensor([1.0, 2.0], dtype=torch.bfloat16),  # Tensor.numpy(): untyped TypeError
    torch.tensor([1.0, 2.0], requires_grad=True),  # untyped RuntimeError
    torch.empty(2, dtype=torch.bits8),
    [2, True],  # numpy made it [2, 1]: True moved page 1
    [np.int64(2), np.bool_(True)],
    [2, torch.tensor(True)],  # a 0-d bool tensor in a list: numpy took it as page 1 too
    [2, np.array(True)],
], ids=["bf16", "requires-grad", "bits8", "bool-in-list", "numpy-bool-in-list", "bool-tensor-in-list",
        "bool-array-in-list"])
def test_page_ids_that_are_not_integers_are_dtype_errors_on_both_sides(ids):
    pool, host = make(torch.bfloat16)
    snap = snapshot(pool, host)
    with pytest.raises(TensorDtypeError):
        offload_pages(pool._storage.caches, host, ids, [3, 4])
    with pytest.raises(TensorDtypeError):
        offload_pages(pool._storage.caches, host, [3, 4], ids)
    with pytest.raises(TensorDtypeError):
        load_pages(host, pool._storage.caches, ids, [3, 4])
    assert unchanged(pool, host, snap)
    with pytest.raises(TensorShapeError, match="dense"):
        offload_pages(pool._storage.caches, host, torch.tensor([1, 2]).to_sparse(), [3, 4])
    assert unchanged(pool, host, snap)


def test_duplicate_device_destination_is_refused():
    pool, host = make(torch.bfloat16)
    snap = snapshot(pool, host)
    with pytest.raises(DuplicateSlotError, match="page 4 twice"):
        load_pages(host, pool._storage.caches, [1, 2], [4, 4])
    assert unchanged(pool, host, snap)


def test_mismatched_storage_is_refused():
    pool, host = make(torch.bfloat16)
    other_dtype = HostStorage(6, num_layers=LAYERS, page_size=4, heads=2, head_dim=8, dtype=torch.float16)
    other_heads = HostStorage(6, num_layers=LAYERS, page_size=4, heads=1, head_dim=8, dtype=torch.bfloat16)
    other_layers = HostStorage(6, num_layers=2, page_size=4, heads=2, head_dim=8, dtype=torch.bfloat16)
    mla_host = HostStorage(6, num_layers=LAYERS, page_size=4, heads=2, head_dim=8, dtype=torch.bfloat16, mla=True)
    odd_page = HostStorage(6, num_layers=LAYERS, page_size=3, heads=2, head_dim=8, dtype=torch.bfloat16)
    snap = snapshot(pool, host)
    caches = pool._storage.caches
    with pytest.raises(TensorDtypeError):
        offload_pages(caches, other_dtype, [1], [1])
    for bad in (other_heads, other_layers, mla_host, odd_page):
        with pytest.raises(TensorShapeError):
            offload_pages(caches, bad, [1], [1])
    with pytest.raises(TensorShapeError):
        offload_pages(caches, host.buffer[0], [1], [1])  # not a 6-D page-major buffer
    with pytest.raises(KernelArgumentError):
        offload_pages(caches, "host", [1], [1])
    with pytest.raises(KernelArgumentError):
        offload_pages([], host, [1], [1])
    with pytest.raises(TensorShapeError):
        offload_pages([caches[0][:, :8]], host, [1], [1])  # not contiguous / not the pool's caches
    with pytest.raises(TensorShapeError):
        offload_pages([caches[0], caches[1][:2]], host, [1], [1])
    with pytest.raises(KernelArgumentError, match="method"):
        offload_pages(caches, host, [1], [1], method="dma")
    strided = torch.empty(6, 2, LAYERS, 4, 2, 16, dtype=torch.bfloat16)[..., :8]  # right shape, not contiguous
    with pytest.raises(TensorDeviceError, match="contiguous"):
        offload_pages(caches, strided, [1], [1])
    for layers in (LAYERS, -1, range(0, 0), range(0, 3, 2), True, "0"):
        with pytest.raises(LayerIndexError):
            offload_pages(caches, host, [1], [1], layers=layers)
    assert unchanged(pool, host, snap)


@pytest.mark.skipif(INTERPRETED, reason="runs the interpreter child itself")
def test_through_the_triton_interpreter(tmp_path):
    """Every test above, once more, with the kernel method running the Triton kernel under
    the interpreter (and none skipped: a child that quietly fell back would fail
    test_backend_in_use)."""
    report = tmp_path / "report.xml"
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(kvpool.__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={report}",
         "-k", "not through_the_triton_interpreter", __file__],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] >= 100 and counts["failures"] == counts["errors"] == counts["skipped"] == 0, counts


@pytest.mark.parametrize("direction", ["offload", "load"])
@pytest.mark.parametrize("kind", ["inference", "requires_grad"])
def test_a_destination_torch_cannot_write_is_refused_before_anything_moves(direction, kind):
    """As store_kv and copy_slots refuse it: the moves write raw words, so torch would not."""
    pool, host = make(torch.float32)
    caches = list(pool._storage.caches)
    if direction == "offload":
        with torch.inference_mode() if kind == "inference" else contextlib.nullcontext():
            dst = host.buffer.clone()
        if kind == "requires_grad":
            dst.requires_grad_(True)
        args, name = (caches, dst, [2], [3]), "host"
    else:
        with torch.inference_mode() if kind == "inference" else contextlib.nullcontext():
            caches[1] = caches[1].clone()
        if kind == "requires_grad":
            caches[1].requires_grad_(True)
        dst = caches[1]
        args, name = (host.buffer, caches, [3], [2]), r"device_caches\[1\]"
    before = [bits(t.detach()).clone() for t in caches + [host.buffer, dst]]
    call = offload_pages if direction == "offload" else load_pages
    with torch.enable_grad(), pytest.raises(KernelArgumentError, match=name):
        call(*args)
    assert all(torch.equal(b, bits(t.detach())) for b, t in zip(before, caches + [host.buffer, dst]))
