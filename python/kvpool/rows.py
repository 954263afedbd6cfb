"""``KVPool.write`` and ``KVPool.read``: each argument checked once, then one store or gather.

What never changes for a layer (its token-major views, fp8 scales, the caches'
geometry, which backend moves the rows) is cached when the pool is built, so a
call checks only its own arguments: the layer, the slots, the rows. The kernel
wrappers' own checks (``kernels.store_kv``, ``gather_kv``) are for callers that
hand them arbitrary tensors; the pool calls the stores behind them
(``kernels.ops.store_rows`` / ``gather_rows``) with its cached geometry.

Slots the pool made itself (``ExtendResult.out_cache_loc`` and ``.slots``, the
graph runner's static ``out_cache_loc``) are valid by construction, so their
values are not checked again (see ``PoolSlots``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool._eager import eager_only
from kvpool._forksafe import acquire_interruptible
from kvpool.errors import SlotRangeError, TensorShapeError
from kvpool.kernels import _common
from kvpool.kernels._common import cache_geom, use_triton
from kvpool.kernels.ops import gather_rows, store_rows
from kvpool.pool_slots import PoolSlots
from kvpool.row_stores import _dispatch_modes, index_copy_rows, scatter_into
from kvpool.staging import to_device
from kvpool.tables import ExtendResult
from kvpool.torch_types import INDEX_DTYPES
from kvpool.validate import check_flag, check_layer, check_rows, slots_tensor

__all__ = ["PoolSlots", "RowsMixin", "index_copy_rows", "scatter_into"]

class RowsMixin:
    """Mixin: ``KVPool``'s K/V row writes and reads (``_init_rows`` runs at construction)."""

    num_layers: int
    num_slots: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int | None
    compute_dtype: torch.dtype
    device: torch.device
    mla: bool
    fp8: bool
    _storage: Any
    _scales: list[list[torch.Tensor]]
    _to_device: Any
    _table_np: Any
    _sharing: bool
    _lock: Any
    _transfers: Any  # (kvpool.host_tier; None without a host tier)
    allocator: Any

    def _init_rows(self) -> None:
        flat = self._storage.flat
        # Per layer: the token-major caches ([k, v] or [latent]) and their fp8 scales.
        self._row_caches = [tuple(c[i] for c in flat) for i in range(self.num_layers)]
        self._row_scales = [
            tuple(s[i] for s in self._scales) if self._scales else (None,) * len(flat)
            for i in range(self.num_layers)
        ]
        # Every layer is a block of the same [num_layers, num_slots, H, D] tensor: one geometry.
        self._row_geom = tuple(cache_geom(c[0], "cache") for c in flat)
        self._row_shape = (self.num_kv_heads, self.head_dim)
        self._row_kernel = use_triton(flat[0][0])  # Triton on CUDA (and CPU under TRITON_INTERPRET)
        self._row_stores: Any = None
        if self._row_kernel:  # (imports Triton: only a Triton pool)
            from kvpool.kernels.layer_stores import LayerStores

            self._row_stores = LayerStores(self._row_caches, self._row_scales, self._row_geom[0],
                                           self._row_geom[-1])
        # The common CPU case: a store is one index_copy_ per cache (fp8 goes through
        # the torch reference, which quantizes).
        self._row_plain = not self._row_kernel and not self.fp8
        # [num_slots, H, 1, D] views: a decode step's [B, H, 1, D] K/V (attention's layout,
        # one token) is then stored by index_copy_ as it is, without a reshape.
        self._row_caches_bh1d = [tuple(c.unsqueeze(2) for c in cs) for cs in self._row_caches]
        self._own_slots: PoolSlots | None = PoolSlots() if not self._row_kernel else None
        self._device_slots_fast = self.device.type == "cuda"

    # ----- slots the pool made ------------------------------------------------

    def _own_result(self, slots: np.ndarray, loc: torch.Tensor | None = None) -> ExtendResult:
        """The ``ExtendResult`` of new host ``slots`` (``loc``: their device tensor on CUDA),
        remembered as the pool's own so that writes into them skip the value checks."""
        if loc is not None:
            return ExtendResult(slots, loc)
        if torch.is_inference_mode_enabled():
            # A normal tensor even under inference mode: it has a version counter, so a later
            # in-place change is seen (and it can be written outside inference mode too).
            # The guard torch.inference_mode(False) enters, without its Python wrapper.
            with torch._C._InferenceMode(False):
                loc = torch.from_numpy(slots)
        else:
            loc = torch.from_numpy(slots)
        if self._own_slots is not None:
            self._own_slots.add(loc, slots, clean=True, negative=False)
        return ExtendResult(slots, loc)

    def _extend_host(self, handles: Any, counts: Any, out: np.ndarray | None = None) -> np.ndarray | None:
        """``extend(handles, counts).slots`` without ``out_cache_loc``, where ``extend`` is the
        allocator's call alone (a CPU pool whose core writes the host table, no shared pages);
        None elsewhere (also with a host tier: an extend that evicts queues its offloads, which
        ``extend`` runs before the step writes the evicted pages): then call ``extend``. ``out``:
        the allocator's ``out=`` (the slots are written there and it is returned), for a caller
        that makes the same step again and again.

        For kvpool's own callers that store a step through views of the caches and never
        use the tensor (``KVPoolCache``): under inference mode, making it a normal tensor
        (``_own_result``) leaves and re-enters inference mode, and on a small model's
        decode step that round trip is a measurable share of the cache's host time.
        """
        if self._to_device is not None or self._table_np is None or self._transfers is not None:
            return None
        lock = self._lock
        acquire_interruptible(lock)
        try:
            if self._sharing:
                return None
            if out is None:
                return self.allocator.extend(handles, counts, table=self._table_np)
            return self.allocator.extend(handles, counts, table=self._table_np, out=out)
        finally:
            lock.release()

    def _trust_slots(self, slots: torch.Tensor, *, negative: bool) -> None:
        """Record ``slots`` (values already checked in range by the caller, padding allowed)
        as valid while unchanged: the graph runner's static ``out_cache_loc``."""
        if self._own_slots is not None:
            self._own_slots.add(slots, clean=False, negative=negative)

    def _slots(self, slots: Any, strict: bool, *, store: bool = False) -> tuple[torch.Tensor, bool | None]:
        """``slots`` as an index tensor on the pool's device, and whether any may be negative.

        ``store``: for ``write``; a caller's 1-D integer CPU tensor on a CPU pool that stores
        with the core's row copy is returned as it is, with None for "not checked yet":
        ``scatter_rows`` checks every value before it writes (``write``), which is the
        same check without a second pass over the slots (~15 µs at 1 row on the EPYC VM).
        """
        own = self._own_slots
        if own is None and self._device_slots_fast:
            # A 1-D integer tensor already on this (CUDA) pool's device: what slots_tensor
            # returns for it, unchecked and maybe negative, without its ~5 µs of calls.
            if (type(slots) is torch.Tensor and slots.dtype in INDEX_DTYPES and slots.dim() == 1
                    and slots.device == self.device):
                return slots, True
        elif own is not None and not torch.compiler.is_compiling():
            rec = own.get(slots)
            if rec is not None and (rec[3] or not strict):
                return rec[0], rec[4]
            if (store and not strict and self._row_plain and type(slots) is torch.Tensor
                    and slots.dtype in INDEX_DTYPES and slots.dim() == 1 and slots.device == self.device):
                return slots, None
        idx, negative = slots_tensor(slots, self.device, self.num_slots, self.page_size, strict=strict)
        if idx.device != self.device:
            # Host slots, eager only (rejected while capturing): staged like extend's copy.
            idx = to_device(idx.numpy(), self.device, self._to_device)
        return idx, negative

    # ----- writes and reads ---------------------------------------------------

    def write(self, layer: int, slots: Any, k: torch.Tensor, v: torch.Tensor | None = None, *,
              strict: bool = False) -> None:
        """Store rows ``k[i]`` / ``v[i]`` at ``slots[i]`` of ``layer``, in place.

        Everything is validated before anything is written (typed errors, pool
        unchanged). Negative slots are padding and skipped. Slots in page 0
        (``[0, page_size)``) are the padding sink and accepted, since the
        allocator never gives them to a request; ``strict=True`` rejects them
        (and negatives) with ``ReservedSlotError``, and repeated host slots with
        ``DuplicateSlotError``, for batches known to hold only real tokens (a
        repeated slot gets one of its rows, which one is unspecified and may
        differ between CPU and GPU). Stores as ``kvpool.kernels.store_kv`` does (Triton on
        CUDA, capture-safe; torch on CPU), with the geometry checked once at construction.

        Args:
            layer: layer index.
            slots: ``[n]`` slots: an int32/int64 tensor on the host or the pool's
                device (other tensor dtypes are refused), or a numpy array of any integer
                dtype or a list of ints (taken by value), e.g. ``ExtendResult.out_cache_loc``.
                Host slots are range-checked; device slots are not (no sync).
                On a CUDA pool host slots are staged through pinned memory, and
                rejected while a CUDA graph is being captured (their copy cannot
                be captured): pass device slots there. Slots this pool returned
                (``ExtendResult.out_cache_loc`` / ``.slots`` of its last few
                extends) skip the range check while torch sees them unchanged
                (``PoolSlots``: one changed behind torch's back is still refused
                with nothing written, but escapes ``strict``). ``write`` does not
                know which request holds a slot: slots kept after ``close``,
                ``truncate``, ``reset`` or ``swap_out`` gave them back are in
                range and are written, into whichever request holds them now;
                not reusing them is the caller's part.
            k, v: ``[n, num_kv_heads, head_dim]`` rows of ``compute_dtype`` on the
                pool's device. MLA pools: ``write(layer, slots, kv)`` without ``v``.
            strict: reject padding, page-0 and repeated slots.

        Raises:
            LayerIndexError, SlotRangeError, ReservedSlotError, DuplicateSlotError,
            TensorShapeError, TensorDtypeError, TensorDeviceError: a bad argument
            (nothing written).
        """
        if not self._device_slots_fast and torch.compiler.is_compiling():
            # A host pool's checks read slot values: the call runs eagerly, one graph break,
            # rather than Dynamo compiling the rest of it once per layer and batch size. The
            # arguments go in one tuple: at a graph break torch 2.4 guards every value on the
            # stack (layer == 0, k.shape[0] == 3), so this frame compiled once per layer and
            # batch size; values inside a tuple are passed on unguarded (kvpool._eager).
            return _write_eager(self, *(layer, slots, k, v), strict=strict)
        if type(layer) is not int or not 0 <= layer < self.num_layers:
            layer = check_layer(layer, self.num_layers)
        if self.mla:
            if v is not None:
                raise TensorShapeError("an MLA pool takes one latent tensor: write(layer, slots, kv), without v")
        elif v is None:
            raise TensorShapeError("write(layer, slots, k, v) needs both k and v")
        if strict is not False and strict is not True:
            strict = check_flag("strict", strict)
        idx, negative = self._slots(slots, strict, store=True)
        if self._row_plain:
            # The core's row copy checks the rows as the loop below would (exactly a tensor,
            # the caches' dtype and row shape, one row a slot, dense CPU memory) and declines
            # anything else, which the loop then names; it copies bytes, so a source that
            # requires grad needs no detach.
            try:
                if scatter_into(self._row_caches[layer], idx, (k,) if v is None else (k, v)):
                    return
            except IndexError:
                # Nothing written: the slots are a caller's, or a pool-made tensor changed behind
                # torch's back (PoolSlots). Name the bad slot as a caller's tensor is named.
                slots_tensor(idx, self.device, self.num_slots, self.page_size, strict=False)
                raise SlotRangeError(f"a slot is out of range: valid slots are [0, {self.num_slots})") from None
        want = (idx.shape[0],) + self._row_shape
        dtype, dev = self.compute_dtype, self.device
        for name, x in (("kv", k),) if v is None else (("k", k), ("v", v)):
            if not (isinstance(x, torch.Tensor) and x.dtype == dtype and x.shape == want and x.device == dev
                    and x.layout is torch.strided):
                if negative is None:  # a bad slot is named before a bad row
                    self._slots(slots, strict)
                check_rows(name, x, want[0], want[1], want[2], dtype, dev)  # raises the precise error
        # detach(): a source that requires grad must not drag the cache into
        # autograd (in grad mode, the store would make the cache require grad).
        if k.requires_grad:
            k = k.detach()
        if v is not None and v.requires_grad:
            v = v.detach()
        if want[0] == 0:
            return
        if self._own_slots is not None:  # a CPU pool storing with torch: off the row copy's path
            idx, negative = self._recheck(slots, idx, negative)
        if self._row_plain:
            self._copy_rows(self._row_caches[layer], idx, negative, k, v)
            return
        assert negative is not None  # only the row copy takes unchecked slots
        try:
            self._store_checked(layer, idx, k, v)  # the kernels skip negative slots themselves
        except IndexError:
            # As in _copy_rows: only a pool-made tensor changed behind torch's back gets here.
            slots_tensor(idx, self.device, self.num_slots, self.page_size, strict=False)
            raise SlotRangeError(f"a slot is out of range: valid slots are [0, {self.num_slots})") from None

    def _recheck(self, slots: Any, idx: torch.Tensor, negative: bool | None) -> tuple[torch.Tensor, bool | None]:
        """``idx`` checked in full if it is a pool-made tensor (``PoolSlots``) about to be stored
        by torch (fp8's quantizing store, or rows the core's row copy declined): a value changed
        behind torch's back (``.numpy()``, ``.data``) would be refused by torch only after the rows
        before it were stored. Those stores cost far more than this pass over the slots; the
        row copy, which checks every slot before it copies, skips it. Not while torch.compile or
        a dispatch mode (make_fx) traces: the check would be data-dependent there."""
        own = self._own_slots
        # (compiling first: Dynamo would trace the ring's lookup and guard on its numpy arrays)
        if (negative is None or own is None or torch.compiler.is_compiling() or _dispatch_modes()
                or own.get(slots) is None):
            return idx, negative
        return slots_tensor(idx, self.device, self.num_slots, self.page_size, strict=False)

    def _store_checked(self, layer: int, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """``write`` for callers inside kvpool that have checked ``k``/``v`` themselves and
        pass slots this pool made (no padding): the store alone."""
        caches = self._row_caches[layer]
        if self._row_plain:
            if not scatter_into(caches, idx, (k,) if v is None else (k, v)):
                caches[0].index_copy_(0, idx, k)
                if v is not None:
                    caches[1].index_copy_(0, idx, v)
            return
        stores = self._row_stores
        # A Triton pool's eager store, with what never changes read once. (The generic path
        # asks for the backend at each call, and the tests' torch twins turn the interpreter
        # off for a CPU pool made under it: that pool must take the generic path then.)
        if (stores is not None and (self._device_slots_fast or _common.INTERPRET)
                and not torch.compiler.is_compiling()):
            stores.store(layer, idx, k, v)
            return
        scales, kg = self._row_scales[layer], self._row_geom[0]
        if v is None:
            store_rows(caches[0], None, idx, k, None, scales[0], None, kg, kg)
        else:
            store_rows(caches[0], caches[1], idx, k, v, scales[0], scales[1], kg, self._row_geom[1])

    def _store_bhtd(self, layer: int, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``_store_checked`` of K/V in attention's ``[B, H, T, D]`` layout (``idx``: the B*T
        slots row-major), as a transformers cache receives them."""
        if k.requires_grad or v.requires_grad:
            k, v = k.detach(), v.detach()
        b, h, t, d = k.shape
        if self._row_plain:
            if t == 1:
                kc, vc = self._row_caches_bh1d[layer]
                if not scatter_into((kc, vc), idx, (k, v)):
                    kc.index_copy_(0, idx, k)
                    vc.index_copy_(0, idx, v)
            else:
                # Indexed by [B, T] slots, the caches take the [B, T, H, D] transposes as they
                # are: no contiguous copy of a prompt's K/V first.
                kc, vc = self._row_caches[layer]
                at = (idx.view(b, t),)
                kc.index_put_(at, k.transpose(1, 2))
                vc.index_put_(at, v.transpose(1, 2))
            return
        self._store_checked(layer, idx, k.transpose(1, 2).reshape(b * t, h, d),
                            v.transpose(1, 2).reshape(b * t, h, d))

    def _copy_rows(self, caches: tuple[torch.Tensor, ...], idx: torch.Tensor, negative: bool | None,
                   k: torch.Tensor, v: torch.Tensor | None) -> None:
        """The torch store of a non-fp8 CPU pool, one ``index_copy_`` per cache: for rows
        the core's row copy declined (``write`` tries it first). ``negative`` None: a
        caller's slots, not checked yet (``_slots(store=True)``)."""
        if negative is None:  # the row copy declined them: check them here
            idx, negative = slots_tensor(idx, self.device, self.num_slots, self.page_size, strict=False)
        if negative:
            keep = (idx >= 0).nonzero().squeeze(1)
            if keep.shape[0] != idx.shape[0]:
                idx, k = idx.index_select(0, keep), k.index_select(0, keep)
                v = v.index_select(0, keep) if v is not None else None
        if idx.dtype != torch.int64:
            idx = idx.long()
        try:
            index_copy_rows(caches, idx, k, v)
        except IndexError:
            # Only a pool-made tensor changed behind torch's back gets here unchecked (while
            # tracing, or changed by another thread after ``_recheck``); name the bad slot as a
            # caller's tensor would be named. If every slot is in range, the change made some
            # padding: skip it as a caller's.
            _, negative = slots_tensor(idx, self.device, self.num_slots, self.page_size, strict=False)
            if not negative:
                raise SlotRangeError(f"a slot is out of range: valid slots are [0, {self.num_slots})") from None
            self._copy_rows(caches, idx, True, k, v)

    def read(self, layer: int, slots: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather rows at ``slots`` as ``compute_dtype`` (fp8 dequantized); negative slots read zeros.

        A helper for tests and debugging, not the attention path (gathers as
        ``kvpool.kernels.gather_kv`` does; allocates its outputs).

        Args:
            layer: layer index.
            slots: ``[n]`` slots, as for ``write``.

        Returns:
            ``(k, v)``, each ``[n, num_kv_heads, head_dim]`` new tensors. MLA:
            ``(latent, latent[..., :kv_lora_rank])``.

        Raises:
            LayerIndexError, SlotRangeError, TensorShapeError, TensorDtypeError,
            TensorDeviceError: a bad argument.
        """
        if not self._device_slots_fast and torch.compiler.is_compiling():
            return _read_eager(self, *(layer, slots))  # as in write (the tuple too)
        if type(layer) is not int or not 0 <= layer < self.num_layers:
            layer = check_layer(layer, self.num_layers)
        idx, negative = self._slots(slots, False)
        caches = self._row_caches[layer]
        try:
            if self._row_plain and not negative:
                if idx.dtype != torch.int64:
                    idx = idx.long()
                out = tuple(c.index_select(0, idx) for c in caches)
            else:
                out = self._gather(layer, idx)
        except IndexError:
            # Only a pool-made tensor changed behind torch's back gets here unchecked
            # (PoolSlots): check it as a caller's (SlotRangeError); in range, it holds
            # padding, which the gather reads as zeros.
            idx, _ = slots_tensor(idx, self.device, self.num_slots, self.page_size, strict=False)
            out = self._gather(layer, idx)
        if len(out) == 1:
            return out[0], out[0][..., : self.kv_lora_rank]
        return out[0], out[1]

    def _gather(self, layer: int, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``read``'s gather of ``layer``'s rows at ``idx`` into new tensors (padding reads zeros)."""
        caches = self._row_caches[layer]
        n, (h, d) = idx.shape[0], self._row_shape
        out = tuple(torch.empty((n, h, d), dtype=self.compute_dtype, device=self.device) for _ in caches)
        scales = self._row_scales[layer]
        kg = self._row_geom[0]
        if n:
            if len(caches) == 1:
                gather_rows(caches[0], None, idx, out[0], None, self.compute_dtype, scales[0], None, kg, kg)
            else:
                gather_rows(caches[0], caches[1], idx, out[0], out[1], self.compute_dtype, scales[0],
                            scales[1], kg, self._row_geom[1])
        return out


# write / read of a host pool while torch.compile traces: run eagerly (see write).
_write_eager: Any = eager_only(globals(), "_write_eager", RowsMixin.write)
_read_eager: Any = eager_only(globals(), "_read_eager", RowsMixin.read)
