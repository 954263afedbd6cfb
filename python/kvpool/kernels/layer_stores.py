"""``store_rows`` for one pool's layers, with what never changes for the pool worked out once.

``KVPool.write`` on a Triton pool (CUDA, or the CPU under ``TRITON_INTERPRET=1``) is one store
launch per layer per step, and an eager engine pays the Python in front of each launch on
every layer of every step. The generic path (``kernels.ops.store_rows`` ->
``kernels.store.launch_store_kv``) reads, at every call, what is fixed when the pool is made:
each layer's caches and scales, their dtypes, addresses and geometry, and the caches' storages
(asked to see whether the rows view them). ``LayerStores`` reads those once and keeps each
layer's part of the launch key as a small integer, so a call reads only the rows' and the
slots' own properties and hashes a short key. Same kernel, same plans (``store._plan``), same
results; the generic path stays for callers of ``kernels.store_kv`` and under torch.compile.

Imported only by Triton pools (it imports the kernel module, and with it Triton).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from kvpool.kernels import _common as c
from kvpool.kernels import store
from kvpool.kernels._guard import on_device
from kvpool.kernels.launch import launch_planned

__all__ = ["LayerStores"]

# Each distinct per-layer constant part of a launch key, by a small integer: the key is hashed
# at every launch, and a tuple does not keep its hash, so the constant part (two geometries of
# eight ints, dtypes, alignments) would be hashed again each time. A process sees a handful.
_CONSTANT_IDS: dict[tuple, int] = {}
_CONSTANT_IDS_LOCK = threading.Lock()  # (pools made on several threads: one id per part)


class LayerStores:
    """``store_rows(caches[layer]..., slots, k, v)`` for a pool whose per-layer ``caches``
    (``(k, v)`` or ``(latent,)``), ``scales`` and geometry ``kg``/``vg`` never change: the
    caller has checked ``k``/``v`` (shape, dtype, device) and the slots as ``store_rows``'s
    callers do."""

    def __init__(self, caches: list[tuple[torch.Tensor, ...]], scales: list[tuple[Any, ...]],
                 kg: c.CacheGeom, vg: c.CacheGeom) -> None:
        self._layers = [_layer(cs, sc, kg, vg) for cs, sc in zip(caches, scales)]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """``k``/``v`` rows at ``slots`` of ``layer`` (negative slots skipped by the kernel).
        Eager only: under torch.compile the caller takes ``store_rows``."""
        kc, vc, has_v, k_scale, v_scale, ks, vs, constant, storages, kg, vg, device, index = self._layers[layer]
        # Rows that view a cache are stored as they were at the call (``store_rows``): the
        # kernel's programs would otherwise read rows other programs had overwritten.
        if c.readable(k) in storages:
            k = k.clone()
        if k.is_neg():  # the kernel reads memory as it is; torch's stores resolve the bit
            k = k.resolve_neg()
        vv = k
        if has_v:
            assert v is not None
            if c.readable(v) in storages:
                v = v.clone()
            if v.is_neg():
                v = v.resolve_neg()
            vv = v
        n = k.shape[0]
        key = store.store_key(constant, slots, k, vv, index)  # (the per-layer part as its number)
        with on_device(device):
            launch_planned(store._LAUNCH, store._store_kv_kernel, store._PLANS, key,
                           lambda: store._plan(kc, vc, slots, k, vv, kg, vg, has_v, k_scale, v_scale, n),
                           (kc, vc, slots, k, vv, ks, vs), n, kc.is_cuda)


def _layer(cs: tuple[torch.Tensor, ...], sc: tuple[Any, ...], kg: c.CacheGeom, vg: c.CacheGeom) -> tuple:
    kc = cs[0]
    has_v = len(cs) > 1
    vc = cs[1] if has_v else kc  # without V the kernel gets K's tensors (never touched)
    k_scale = sc[0]
    v_scale = sc[1] if has_v else None
    if not has_v:
        vg = kg
    ks, _ = c.scale_args(k_scale, kc)
    vs, _ = c.scale_args(v_scale, vc)
    constant = store.store_key_constant(kc, vc, kg, vg, has_v, k_scale, v_scale)
    with _CONSTANT_IDS_LOCK:
        ident = _CONSTANT_IDS.setdefault(constant, len(_CONSTANT_IDS))
    storages = tuple({t.untyped_storage().data_ptr() for t in cs})
    return kc, vc, has_v, k_scale, v_scale, ks, vs, ident, storages, kg, vg, kc.device, kc.get_device()
