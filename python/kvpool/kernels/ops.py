"""The four ways kvpool moves K/V and table entries, on every device.

Each function validates its arguments (typed errors, nothing written on
failure), then runs one backend: the Triton kernel on CUDA tensors (and on CPU
under TRITON_INTERPRET=1), the torch implementation in ``_ref`` on CPU. The
Triton modules are imported inside the launch branch, so this module (and
``KVPool`` on CPU) imports without Triton; on CUDA without a usable Triton the
call raises ``TritonUnavailableError`` instead of falling back to torch.
The table write (``write_req_to_token``) lives in ``table_ops`` and is re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.errors import DuplicateSlotError
from kvpool.kernels import _common as c
from kvpool.kernels import _ref
from kvpool.kernels._guard import on_device
from kvpool.kernels.table_ops import write_req_to_token
from kvpool.torch_types import GATHER_DTYPES

__all__ = ["copy_slots", "gather_kv", "store_kv", "write_req_to_token"]


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None = None,
    k_scale: c.Scale = None,
    v_scale: c.Scale = None,
) -> None:
    """Write k[i] (and v[i]) into the caches at slots[i], in place, one launch.

    Args:
        k_cache, v_cache: token-major [num_slots, H, D] or paged [num_pages, P, H, D]
            caches (any strides). ``v_cache=None`` with ``v=None`` writes K only
            (single-cache / MLA latent mode).
        slots: int32/int64 [n] on the caches' device; negative entries are skipped.
            Device slots are not range-checked (that would need a device read; the
            pool hands out only valid slots); CPU slots are (``SlotRangeError``). A
            slot repeated within one call is written by several rows in parallel and
            which one lands is unspecified (it may differ between CPU and GPU): repeat
            only padding sinks (page 0, whose content is meaningless). The allocator
            never repeats a real slot.
        k, v: [n, H, D] rows of any cache dtype (``CACHE_DTYPES``), converted to the
            cache's dtype as they are stored (a cast; fp8 caches clamp first, see below):
            ``KVPool.write`` is the call that refuses rows of another dtype. On CPU they may
            be views of the caches (stored as they were at the call); on CUDA a source row that the same call also writes is
            read and written in parallel, so which value it gives is unspecified.
        k_scale, v_scale: None, a float or a 1-element tensor (read at launch, so a
            captured graph sees later updates). fp8 caches store clamp(x / scale);
            other dtypes store x (divided by the scale when one is given).

    Raises:
        TensorShapeError, TensorDtypeError, TensorDeviceError, KernelArgumentError,
        SlotRangeError (CPU slots only): a bad argument (nothing written).
        TritonUnavailableError: CUDA tensors and no usable Triton.
    """
    kg = c.cache_geom(k_cache, "k_cache")
    c.check_writable(k_cache, "k_cache")
    dev = k_cache.device
    c.check_rows(k, "k", kg, dev)
    n = k.shape[0]
    c.check_index(slots, "slots", dev, n)
    c.check_slot_range(slots, "slots", kg.num_slots)
    c.check_scale(k_scale, "k_scale", dev)
    if (v_cache is None) != (v is None):
        raise c.KernelArgumentError("v_cache and v must both be given or both be None")
    vg = kg
    if v_cache is not None and v is not None:
        vg = c.cache_geom(v_cache, "v_cache")
        c.check_writable(v_cache, "v_cache")
        _check_same_device(v_cache, dev)
        if (vg.num_slots, vg.page_size) != (kg.num_slots, kg.page_size):
            raise c.KernelArgumentError(
                f"v_cache has {vg.num_slots} slots / page size {vg.page_size}, "
                f"k_cache has {kg.num_slots} / {kg.page_size}"
            )
        if (vg.heads, vg.head_dim) != (kg.heads, kg.head_dim):
            raise c.KernelArgumentError(
                f"v_cache rows are [{vg.heads}, {vg.head_dim}], k_cache rows "
                f"[{kg.heads}, {kg.head_dim}]; use separate store_kv calls"
            )
        c.check_rows(v, "v", vg, dev)
        if v.shape[0] != n:
            raise c.TensorShapeError(f"v has {v.shape[0]} rows, k has {n}")
        c.check_scale(v_scale, "v_scale", dev)
    if n == 0:
        return
    store_rows(k_cache, v_cache, slots, k, v, k_scale, v_scale, kg, vg)


def store_rows(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    k_scale: c.Scale,
    v_scale: c.Scale,
    kg: c.CacheGeom,
    vg: c.CacheGeom,
) -> None:
    """``store_kv`` after its checks: arguments already validated, ``kg``/``vg`` the
    caches' geometry (``vg`` is ``kg`` without V). ``KVPool.write`` calls this with the
    geometry it cached at construction, so a write checks its arguments once.
    Without V the kernel gets K's tensors in V's place (never touched: HAS_V=False)."""
    if not (k_cache.is_cuda and torch.compiler.is_compiling()):
        # Rows that are views of a cache (moving rows within a layer) are stored as they
        # were at the call, as KVPool.write stores them, on every device: index_copy_ refuses
        # a source overlapping its destination, and would refuse V's after K's store went
        # through; the kernel (Triton's interpreter on the CPU, and on a GPU its programs in
        # parallel) would read rows that other programs had already overwritten. (Not while
        # Dynamo traces a CUDA write: the storage lookups would break its graph.)
        k_views, v_views = c.rows_viewing((k_cache, v_cache), k, v)
        if k_views:
            k = k.clone()
        if v_views:
            v = v.clone()
    if not c.use_triton(k_cache):
        # In grad mode torch's in-place store of a source that requires grad would make
        # the cache require grad too (a grad_fn on the caller's cache); the kernel copies
        # bytes, so both backends leave the cache out of autograd.
        if k.requires_grad:
            k = k.detach()
        if v is not None and v.requires_grad:
            v = v.detach()
        _ref.store_kv_ref(k_cache, v_cache, slots, k, v, k_scale, v_scale)
        return
    from kvpool.kernels.store import launch_store_kv

    # A negative-bit view (``x.conj().imag``) holds -x in memory, which the kernel would read
    # as it is: torch's stores resolve the bit, so resolve it here too (a copy, only then).
    if k.is_neg():
        k = k.resolve_neg()
    if v is not None and v.is_neg():
        v = v.resolve_neg()
    has_v = v_cache is not None and v is not None
    with on_device(k_cache.device):
        if has_v:
            launch_store_kv(k_cache, v_cache, slots, k, v, kg, vg, True, k_scale, v_scale)
        else:
            launch_store_kv(k_cache, k_cache, slots, k, k, kg, kg, False, k_scale, None)


def _check_same_device(v_cache: torch.Tensor, dev: torch.device) -> None:
    # Checked before anything moves: K would be stored before V's write failed.
    if v_cache.device != dev:
        raise c.TensorDeviceError(f"v_cache is on {v_cache.device}, k_cache on {dev}: both caches "
                                  "must be on one device")


def _check_out(out: torch.Tensor | None, name: str, n: int, g: c.CacheGeom, dtype, dev) -> None:
    if (
        not isinstance(out, torch.Tensor)
        or out.layout is not torch.strided
        or tuple(out.shape) != (n, g.heads, g.head_dim)
        or out.dtype != dtype
        or out.device != dev
        or not out.is_contiguous()
        or out.is_neg()  # (a negative-bit view: the kernel's raw writes would read back negated)
    ):
        raise c.KernelArgumentError(
            f"{name} must be a contiguous {dtype} tensor of shape [{n}, {g.heads}, {g.head_dim}] "
            f"on {dev}"
        )
    c.check_writable(out, name)


def _byte_span(t: torch.Tensor) -> tuple[torch.device, int, int]:
    """(device, first address, one past the last) of the bytes ``t``'s elements occupy: addresses,
    not storages, as two storages can hold one memory (``torch.from_numpy``, DLPack)."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) * t.element_size()
    return t.device, t.data_ptr(), t.data_ptr() + last + t.element_size()


def _check_out_apart(outs: tuple[tuple[torch.Tensor | None, str], ...],
                     caches: tuple[tuple[torch.Tensor | None, str], ...]) -> None:
    """``gather_kv``'s outputs share no memory with the caches it reads or with each other
    (metadata only: capture-safe). Gathering into the memory it gathers from, or K and V
    into one tensor, gives what the backend's order of reads and writes makes of it: torch
    reads every row first, the kernel reads and writes row by row (in parallel on a GPU)."""
    spans = [(name, _byte_span(t)) for t, name in outs if t is not None and t.numel()]
    read = [(name, _byte_span(t)) for t, name in caches if t is not None and t.numel()]
    for i, (name, (dev, lo, hi)) in enumerate(spans):
        for other, (dev2, lo2, hi2) in read + spans[i + 1:]:
            if dev == dev2 and lo < hi2 and lo2 < hi:
                raise c.KernelArgumentError(
                    f"{name} overlaps {other} in memory: the gather would write memory it reads or "
                    "writes again, and which value a row gets would depend on the backend (torch "
                    "reads every row first, the kernel row by row, in parallel on a GPU); gather "
                    "into tensors of their own")


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slots: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    k_scale: c.Scale = None,
    v_scale: c.Scale = None,
    out: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read the rows at ``slots`` into contiguous [n, H, D] tensors (reference
    attention, export, offload).

    Args:
        k_cache, v_cache: caches as for ``store_kv`` (``v_cache`` may be None).
        slots: int32/int64 [n]; rows of negative slots come back zero.
        out_dtype: dtype of the result (default: the cache dtype): a cache dtype, or
            torch.float64 (``kvpool.torch_types.GATHER_DTYPES``). Into fp8, values past
            the format's finite range saturate to its largest value (NaN stays NaN).
        k_scale, v_scale: with a scale, rows are dequantized as x * scale.
        out: ``(k_out, v_out)`` to write into instead of allocating (e.g. in a
            captured graph); they may not overlap each other or the caches in memory
            (``KernelArgumentError``, nothing written).

    Returns:
        ``(k, v)``; ``v`` is None when ``v_cache`` is None.

    Raises:
        TensorShapeError, TensorDtypeError, TensorDeviceError, KernelArgumentError:
            a bad argument.
        TritonUnavailableError: CUDA tensors and no usable Triton.
    """
    kg = c.cache_geom(k_cache, "k_cache")
    dev = k_cache.device
    c.check_index(slots, "slots", dev)
    c.check_slot_range(slots, "slots", kg.num_slots)
    n = slots.shape[0]
    vc, vg = k_cache, kg
    if v_cache is not None:
        vc, vg = v_cache, c.cache_geom(v_cache, "v_cache")
        _check_same_device(v_cache, dev)
        # One PAGE for both caches in the kernel: a token-major V next to a paged K
        # (or different page sizes) would be addressed with K's page split.
        if (vg.heads, vg.head_dim, vg.num_slots, vg.page_size) != (
            kg.heads, kg.head_dim, kg.num_slots, kg.page_size
        ):
            raise c.KernelArgumentError(
                "k_cache and v_cache must have the same slots, page size and [H, D]"
            )
    has_v = v_cache is not None
    for s, nm in ((k_scale, "k_scale"), (v_scale, "v_scale")):
        c.check_scale(s, nm, dev)
    if out_dtype is not None and out_dtype not in GATHER_DTYPES:
        # Both backends must refuse alike: torch would cast to an int or complex dtype, the
        # kernel fails to compile for it with an untyped error, and its casts to the fnuz fp8
        # formats round wrong (Triton's interpreter) where torch's are exact.
        raise c.TensorDtypeError(
            f"out_dtype must be a cache dtype or torch.float64 ({', '.join(map(str, GATHER_DTYPES))}), "
            f"got {out_dtype!r}"
        )
    k_dt = out_dtype or k_cache.dtype
    v_dt = out_dtype or vc.dtype
    if out is None:
        k_out = torch.empty((n, kg.heads, kg.head_dim), dtype=k_dt, device=dev)
        v_out = torch.empty((n, kg.heads, kg.head_dim), dtype=v_dt, device=dev) if has_v else None
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise c.KernelArgumentError(
                f"out must be a (k_out, v_out) pair of tensors (v_out None without v_cache), got "
                f"{type(out).__name__}" + (f" of {len(out)}" if isinstance(out, (tuple, list)) else "")
            )
        k_out, v_out = out
        _check_out(k_out, "out[0]", n, kg, k_dt, dev)
        if has_v:
            _check_out(v_out, "out[1]", n, kg, v_dt, dev)
        elif v_out is not None:
            raise c.KernelArgumentError("out[1] must be None without v_cache (nothing is gathered into it)")
        _check_out_apart(((k_out, "out[0]"), (v_out, "out[1]")), ((k_cache, "k_cache"), (v_cache, "v_cache")))
    if n == 0:
        return k_out, v_out
    gather_rows(k_cache, v_cache, slots, k_out, v_out, out_dtype, k_scale, v_scale, kg, vg)
    return k_out, v_out


def gather_rows(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slots: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    k_scale: c.Scale,
    v_scale: c.Scale,
    kg: c.CacheGeom,
    vg: c.CacheGeom,
) -> None:
    """``gather_kv`` after its checks, into ``k_out``/``v_out`` (``v_out`` None without
    V; ``vg`` is then ``kg``). ``KVPool.read`` calls this with its cached geometry."""
    if not c.use_triton(k_cache):
        k_ref, v_ref = _ref.gather_kv_ref(k_cache, v_cache, slots, out_dtype, k_scale, v_scale)
        k_out.copy_(k_ref)
        if v_out is not None and v_ref is not None:
            v_out.copy_(v_ref)
        return
    from kvpool.kernels.gather import launch_gather_kv

    has_v = v_cache is not None
    with on_device(k_cache.device):
        launch_gather_kv(k_cache, v_cache if has_v else k_cache, slots, k_out,
                         v_out if v_out is not None else k_out, kg, vg, has_v, k_scale, v_scale)


def copy_slots(
    caches: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """For every cache, ``cache[dst_slots[i]] = cache[src_slots[i]]`` (rows of H x D),
    in one launch per group of like caches: copy-on-write of a shared page, compaction.

    Args:
        caches: non-empty list of token-major or paged caches on one device, all
            with the same number of slots (slot = page * P + offset).
        src_slots, dst_slots: int32/int64 [n]; pairs with a negative src or dst are
            skipped. Among the other pairs, no dst may repeat and no dst may also be a
            src: rows are copied in parallel, so on a GPU the result would depend on
            scheduling. Host (CPU) slots are checked and rejected with
            ``DuplicateSlotError``; device slots are not (that would need a read-back)
            and their result is then unspecified. The allocator's copy-on-write
            copies always go from shared pages to fresh ones, so they never overlap.

    Raises:
        TensorShapeError, TensorDtypeError, TensorDeviceError, KernelArgumentError:
            a bad argument (nothing copied).
        DuplicateSlotError: host slots whose pairs overlap (see above; nothing copied).
        TritonUnavailableError: CUDA tensors and no usable Triton.
    """
    if not isinstance(caches, (list, tuple)) or len(caches) == 0:
        raise c.KernelArgumentError("caches must be a non-empty list of cache tensors")
    geoms = [c.cache_geom(t, f"caches[{i}]") for i, t in enumerate(caches)]
    dev = caches[0].device
    for i, t in enumerate(caches):
        c.check_writable(t, f"caches[{i}]")
        if t.device != dev:
            raise c.TensorDeviceError(f"caches[{i}] is on {t.device}, caches[0] on {dev}")
        if geoms[i].num_slots != geoms[0].num_slots:
            raise c.KernelArgumentError(
                f"caches[{i}] has {geoms[i].num_slots} slots, caches[0] has {geoms[0].num_slots}"
            )
    c.check_index(src_slots, "src_slots", dev)
    n = src_slots.shape[0]
    c.check_index(dst_slots, "dst_slots", dev, n)
    if n == 0:
        return
    c.check_slot_range(src_slots, "src_slots", geoms[0].num_slots)
    c.check_slot_range(dst_slots, "dst_slots", geoms[0].num_slots)
    if dev.type == "cpu":
        _check_disjoint(src_slots, dst_slots)
    if not c.use_triton(caches[0]):
        _ref.copy_slots_ref(caches, src_slots, dst_slots)
        return
    from kvpool.kernels.copy import launch_copy_slots

    with on_device(dev):
        launch_copy_slots(caches, geoms, src_slots, dst_slots)


def _check_disjoint(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Host slots of one copy_slots call: destinations distinct and not also sources."""
    keep = (src >= 0) & (dst >= 0)
    s, d = src[keep].long(), dst[keep].long()
    uniq, counts = torch.unique(d, return_counts=True)
    if bool((counts > 1).any()):
        raise DuplicateSlotError(
            f"copy_slots: destination slot {int(uniq[counts > 1][0])} appears more than once; "
            "each destination may be written by one pair only"
        )
    both = d[torch.isin(d, s)]
    if both.numel():
        raise DuplicateSlotError(
            f"copy_slots: slot {int(both[0])} is both a destination and a source; rows are "
            "copied in parallel, so split the call (copy into fresh slots first)"
        )
