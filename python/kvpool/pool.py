"""KVPool: K/V tensors and a request-to-token table bound to a SlotAllocator.

The allocator (Rust) decides which slots each request owns; this layer owns
every torch tensor. It never keeps its own copy of ownership state and never
reads a device tensor back: ``req_to_token`` is a write-only mirror updated
with one batched write per ``extend``. Every tensor it keeps is created under
``persistent()`` (``inference_mode(False)`` then ``no_grad()``), so the pool
works the same whether it was built or is used under inference mode, no_grad,
grad mode, torch.compile or from another thread; it never changes the
caller's grad mode.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool._core import InvalidArgumentError, SlotAllocator
from kvpool.distributed.heads import shard_kv_heads
from kvpool.capacity import bytes_per_slot, resolve_num_pages, table_bytes
from kvpool.facade import AllocatorFacade
from kvpool.kernels import require_triton
from kvpool.layout import LAYOUTS, KVStorage, padded_row_stride
from kvpool.modes import persistent
from kvpool.staging import PinnedRing
from kvpool.sharing import SharingMixin, apply_cow
from kvpool.torch_types import FP8_DTYPES, as_device
from kvpool.admission import AdmissionMixin
from kvpool.transfer import ExtendResult, PageTable, page_table_tensors, update_req_to_token
from kvpool.rows import RowsMixin
from kvpool.validate import check_layer

__all__ = ["ExtendResult", "KVPool", "PageTable"]


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class KVPool(AllocatorFacade, SharingMixin, AdmissionMixin, RowsMixin):
    """Per-layer K/V caches (or MLA latent caches) plus ``req_to_token``.

    Capacity: exactly one of ``num_pages`` / ``num_slots`` (totals, reserved
    page 0 included, as in ``SlotAllocator``), ``memory_bytes`` or
    ``memory_fraction`` (of the device's free memory; budgets cover the K/V
    pages plus the tables). ``layout`` picks what ``k_buffer(layer)`` returns:
    ``"token"`` ``[num_slots, H, D]`` or ``"paged"`` ``[num_pages, P, H, D]``
    (same memory either way). MLA: give ``kv_lora_rank`` and
    ``qk_rope_head_dim``, ``num_kv_heads=1`` and ``head_dim`` = their sum.
    FP8 (``dtype=torch.float8_e4m3fn``): writes take ``compute_dtype`` rows
    (default bfloat16) and store ``clamp(x / scale)``; ``read`` multiplies back;
    scales are per layer in ``k_scale`` / ``v_scale`` (float32, initially 1);
    set them in place (``pool.k_scale[layer] = s`` or ``.copy_``), never by
    rebinding the attribute: writes and captured graphs read these tensors.

    Request operations, queries and counters (``open``, ``close``, ``lengths``,
    ``free_pages``, ``check``, ...) are the allocator's, forwarded (see
    ``AllocatorFacade``); ``pool.allocator`` is never needed for ordinary work.

    Shared pages: ``open_with_prefix`` starts requests on cached pages of a
    common prefix, ``cache`` / ``close(cache=True)`` publish pages, ``fork``
    shares a request's pages, and ``extend`` runs copy-on-write copies on the
    device (see ``kvpool.sharing``). ``hash_seed`` fixes the prefix hash (ranks
    and routers that must agree); ``handle_seed`` fixes the handle generations
    (random otherwise), so pools built with the same seed that make the same
    calls hand out the same handles (tensor-parallel ranks; ``tp_pool`` passes
    one agreed seed to both); ``kv_events=False`` stops recording events for
    ``take_events``.

    Raises (constructor):
        InvalidArgumentError: a bad size, dtype, layout, device or capacity
            (nothing is allocated).
        TritonUnavailableError: a CUDA device and no usable Triton.

    Tensor parallelism: ``tp_rank``/``tp_size`` with ``num_kv_heads`` the model's
    total; the pool holds ``num_kv_heads / tp_size`` heads (``num_kv_heads`` is
    then this rank's count, ``kv_head_start`` its first head; MLA replicates the
    latent cache). See ``kvpool.distributed`` and docs/distributed.md.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float16,
        device: Any = "cpu",
        page_size: int = 1,
        num_pages: int | None = None,
        num_slots: int | None = None,
        memory_bytes: int | None = None,
        memory_fraction: float | None = None,
        max_requests: int = 256,
        max_context_len: int = 4096,
        layout: str = "token",
        kv_lora_rank: int | None = None,
        qk_rope_head_dim: int | None = None,
        compute_dtype: torch.dtype | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        hash_seed: int | None = None,
        handle_seed: int | None = None,
        kv_events: bool = True,
    ) -> None:
        self.num_layers = _positive("num_layers", num_layers)
        # Tensor parallelism: num_kv_heads is the model's total; this rank keeps its shard.
        shard = shard_kv_heads(_positive("num_kv_heads", num_kv_heads), tp_rank, tp_size,
                               mla=kv_lora_rank is not None or qk_rope_head_dim is not None)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.total_kv_heads, self.kv_head_start, num_kv_heads = shard.total, shard.start, shard.heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = _positive("head_dim", head_dim)
        self.page_size = _positive("page_size", page_size)
        self.max_requests = _positive("max_requests", max_requests)
        self.max_context_len = _positive("max_context_len", max_context_len)
        if layout not in LAYOUTS:
            raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InvalidArgumentError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.layout, self.dtype, self.device = layout, dtype, as_device(device)
        if self.device.type not in ("cpu", "cuda"):
            # e.g. "meta" holds no data: every table update would fail after
            # the allocator committed.
            raise InvalidArgumentError(f"a KVPool lives on a 'cpu' or 'cuda' device, got {self.device}")
        require_triton(self.device)  # before any allocation: CUDA pools move K/V with Triton only
        self.fp8 = dtype in FP8_DTYPES
        if compute_dtype is None:
            compute_dtype = torch.bfloat16 if self.fp8 else dtype
        elif not self.fp8 and compute_dtype != dtype:
            raise InvalidArgumentError(f"compute_dtype {compute_dtype} differs from dtype {dtype}: only fp8 pools convert")
        elif not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point or (
            compute_dtype in FP8_DTYPES
        ):
            raise InvalidArgumentError(f"compute_dtype must be a non-fp8 floating dtype, got {compute_dtype!r}")
        self.compute_dtype = compute_dtype
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.mla = self._check_mla(kv_lora_rank, qk_rope_head_dim)

        self.bytes_per_slot = bytes_per_slot(num_layers, num_kv_heads, head_dim, dtype, mla=self.mla)
        scale_bytes = 0 if not self.fp8 else 4 * num_layers * (1 if self.mla else 2)
        self.table_bytes = table_bytes(max_requests, max_context_len)
        pages = resolve_num_pages(
            page_size=self.page_size, slot_bytes=self.bytes_per_slot, fixed_bytes=self.table_bytes + scale_bytes,
            num_pages=num_pages, num_slots=num_slots, memory_bytes=memory_bytes,
            memory_fraction=memory_fraction, device=self.device,
        )
        # The allocator validates its own arguments; make it before any tensor
        # so a bad config fails without allocating device memory.
        self.allocator = SlotAllocator(
            pages, self.page_size, self.max_requests, self.max_context_len, hash_seed=hash_seed,
            handle_seed=handle_seed, kv_events=kv_events,
        )
        # Set once a page can have two holders (fork, a prefix hit): from then
        # on extend asks the core for copy-on-write work.
        self._sharing = False
        self.num_pages, self.num_slots = pages, pages * self.page_size
        self.null_row = self.max_requests

        self._storage = KVStorage(
            num_layers=self.num_layers, num_pages=pages, page_size=self.page_size, heads=self.num_kv_heads,
            dim=self.head_dim, dtype=dtype, device=self.device, layout=layout, mla=self.mla,
        )
        with persistent():
            # Last row = null row: padded batch entries read it; nothing writes it.
            # A column slice of a wider table: rows sit an odd number of cache
            # lines apart (layout.padded_row_stride), not max_context_len * 4
            # bytes, which is a multiple of 4 KiB for power-of-two lengths.
            self.req_to_token = torch.zeros(
                (self.max_requests + 1, padded_row_stride(self.max_context_len)),
                dtype=torch.int32, device=self.device,
            )[:, : self.max_context_len]
            self.k_scale: torch.Tensor | None = None
            self.v_scale: torch.Tensor | None = None
            if self.fp8:
                self.k_scale = torch.ones(self.num_layers, dtype=torch.float32, device=self.device)
                # MLA has one latent cache, hence one scale (v_scale is the same tensor).
                self.v_scale = self.k_scale if self.mla else torch.ones_like(self.k_scale)
            self._scales = [
                [s[i : i + 1] for i in range(self.num_layers)] for s in (self.k_scale, self.v_scale) if s is not None
            ]
        # On CPU the table is host memory: the core writes new slots straight into
        # this numpy view of it inside extend's one crossing (zero copy, no torch
        # op on the hot path). Elsewhere extend ships the core's packed result
        # with one copy to kvpool.kernels.write_req_to_token.
        self._table_np: np.ndarray | None = self.req_to_token.numpy() if self.device.type == "cpu" else None
        # CUDA: every host -> device copy (extend's packed update, page tables, host
        # slots given to write) goes through pinned buffers guarded by events: from
        # pageable memory the driver may synchronise with the stream to stage it.
        self._to_device = PinnedRing(self.device).to_device if self.device.type == "cuda" else None
        self._init_rows()  # per-layer views, scales and geometry for write / read

    def _check_mla(self, rank: int | None, rope: int | None) -> bool:
        if rank is None and rope is None:
            return False
        if rank is None or rope is None:
            raise InvalidArgumentError("MLA needs both kv_lora_rank and qk_rope_head_dim (or neither)")
        width = _positive("kv_lora_rank", rank) + _positive("qk_rope_head_dim", rope)
        if self.num_kv_heads != 1 or self.head_dim != width:
            raise InvalidArgumentError(
                f"an MLA pool stores one latent head per slot: pass num_kv_heads=1 and "
                f"head_dim=kv_lora_rank+qk_rope_head_dim={width} "
                f"(got num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim})"
            )
        return True

    # ----- memory figures -------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V (or latent) caches."""
        return self._storage.nbytes

    @property
    def overhead_bytes(self) -> int:
        """Memory the pool uses beyond the K/V bytes: tables, scales, allocator metadata."""
        scales = sum(s.nbytes for s in {id(s): s for s in (self.k_scale, self.v_scale) if s is not None}.values())
        table = self.req_to_token.untyped_storage().nbytes()  # with the row padding
        return table + scales + int(self.allocator.metadata_bytes)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every persistent tensor the pool owns (``audit`` walks these)."""
        out = self._storage.tensors() + [("req_to_token", self.req_to_token)]
        if self.k_scale is not None:
            out.append(("k_scale", self.k_scale))
        if self.v_scale is not None and self.v_scale is not self.k_scale:
            out.append(("v_scale", self.v_scale))
        return out

    # ----- request operations that touch the tables ------------------------
    # (open, truncate, close, reset and the allocator's queries and counters
    # come from AllocatorFacade)

    def extend(self, handles: Any, counts: Any, tokens: Any = None) -> ExtendResult:
        """Grow requests by ``counts`` tokens; write their new slots into ``req_to_token``.

        One crossing into the core. On CPU the core writes the table in place
        (it is host memory); on CUDA one H2D copy and one table-kernel launch,
        no device sync. A new page is taken only when a request's last one is
        full (free pages first, then the least recently used cached page).
        When a request writes into a page it shares (after ``fork``, or a
        ``truncate`` into a shared or cached page), the valid part is first
        copied to a private page: the copy runs here with ``copy_slots`` over
        every layer, and the table is updated, before this returns.

        Args:
            handles: the requests (no duplicates).
            counts: new tokens per request, or one int for all (>= 0).
            tokens: optional token ids of the new positions, flattened like the
                slots (decode steps pass the sampled tokens). Positions of a
                prompt given to ``open_with_prefix`` take its ids; positions
                without ids make their pages uncacheable.

        Returns:
            ``ExtendResult(slots, out_cache_loc)``: the new slots flattened in
            request order, as a host int64 array and as an int64 tensor on the
            pool's device.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            PoolExhaustedError: not enough free or evictable pages (the message says needed vs free).
            ContextTooLongError: a request would pass ``max_context_len``.
            InvalidArgumentError: a negative count, mismatched sizes, a duplicate
                handle, token ids of the wrong length or disagreeing with the prompt.
            Atomic: on any error neither the allocator nor the table changes.
        """
        if self._table_np is not None:
            if tokens is None and not self._sharing:
                slots = self.allocator.extend(handles, counts, table=self._table_np)
            else:
                slots, cow = self.allocator.extend(handles, counts, table=self._table_np, tokens=tokens, cow=True)
                apply_cow(self, cow, table_written=True)
            return self._own_result(slots)
        packed, num_requests, cow = self.allocator.extend_packed(handles, counts, tokens=tokens)
        try:
            slots, dev = update_req_to_token(self.req_to_token, packed, num_requests, self._to_device)
        except BaseException:
            self._roll_back_extend(handles, packed, num_requests, cow)
            raise
        apply_cow(self, cow, table_written=False)
        return self._own_result(slots, dev)

    def _roll_back_extend(self, handles: Any, packed: np.ndarray, num_requests: int, cow: np.ndarray | None) -> None:
        """Undo a committed extend whose table update failed (a CUDA OOM or launch error).

        Truncating to the old lengths (packed's ``starts`` segment), last request
        first, pushes back exactly the pages taken, restoring the free stack's
        order (extend popped them first request first). A request whose shared
        last page was copied on write keeps its private copy, so that copy is run
        first (best effort: the device has just failed once). Cached pages the
        batch evicted stay evicted; their Removed events were already emitted.
        """
        try:
            apply_cow(self, cow, table_written=False)
        except BaseException:  # noqa: BLE001 - the original error is the one to raise
            pass
        stride = num_requests + (num_requests & 1)
        starts = packed[stride : stride + num_requests]
        hs = np.asarray(handles, dtype=np.int64).reshape(-1)
        self.allocator.truncate(hs[::-1].copy(), starts[::-1].copy())

    def page_table(self, handles: Any) -> PageTable:
        """FlashInfer's CSR page table of a batch, int32 tensors on the pool's device.

        Args:
            handles: the batch's requests, in batch order.

        Returns:
            ``PageTable(kv_indptr [B+1], kv_indices, kv_last_page_len [B])``
            (zero copy on CPU; on CUDA one H2D copy from pinned staging).

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
        """
        return page_table_tensors(*self.allocator.page_table(handles), self.device, self._to_device)

    # ----- views ----------------------------------------------------------

    def k_buffer(self, layer: int) -> torch.Tensor:
        """Layer's K cache in the pool's layout (MLA: the latent cache). A view, no copy.

        Returns:
            ``[num_slots, H, D]`` (layout ``"token"``) or ``[num_pages, P, H, D]`` (``"paged"``).

        Raises:
            LayerIndexError: ``layer`` is not an int in ``[0, num_layers)``.
        """
        return self._storage.shaped[0][check_layer(layer, self.num_layers)]

    def v_buffer(self, layer: int) -> torch.Tensor:
        """Layer's V cache in the pool's layout (MLA: the first ``kv_lora_rank`` features
        of the latent cache). A view, no copy.

        Raises:
            LayerIndexError: ``layer`` is not an int in ``[0, num_layers)``.
        """
        layer = check_layer(layer, self.num_layers)
        if self.mla:
            return self._storage.shaped[0][layer][..., : self.kv_lora_rank]
        return self._storage.shaped[1][layer]

    def kv_buffer(self, layer: int) -> torch.Tensor:
        """MLA latent cache ``[num_slots, 1, kv_lora_rank + qk_rope_head_dim]`` (paged: split pages).

        Raises:
            InvalidArgumentError: the pool is not MLA.
            LayerIndexError: ``layer`` is not an int in ``[0, num_layers)``.
        """
        if not self.mla:
            raise InvalidArgumentError("kv_buffer() is for MLA pools; use k_buffer()/v_buffer()")
        return self._storage.shaped[0][check_layer(layer, self.num_layers)]

    @property
    def k_buffers(self) -> list[torch.Tensor]:
        """``k_buffer(layer)`` of every layer (SGLang's ``k_buffer`` list)."""
        return list(self._storage.shaped[0])

    @property
    def v_buffers(self) -> list[torch.Tensor]:
        """``v_buffer(layer)`` of every layer."""
        return [self.v_buffer(i) for i in range(self.num_layers)] if self.mla else list(self._storage.shaped[1])

    def __repr__(self) -> str:
        kind = f"mla(rank={self.kv_lora_rank}, rope={self.qk_rope_head_dim})" if self.mla else "mha"
        return (
            f"KVPool({kind}, layers={self.num_layers}, heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, device={self.device}, layout={self.layout}, page_size={self.page_size}, "
            f"num_slots={self.num_slots}, nbytes={self.nbytes}, overhead_bytes={self.overhead_bytes})"
        )

    # ----- moving requests between pools (kvpool.distributed) ---------------

    def send_request(self, handle: int, dst_rank: int, group: Any = None, **kwargs: Any) -> Any:
        """Send request ``handle``'s K/V to the pool on ``dst_rank``; see
        ``kvpool.distributed.send_request`` (returns ``TransferStats``)."""
        from kvpool.distributed.kv_transfer import send_request
        return send_request(self, handle, dst_rank, group, **kwargs)

    def recv_request(self, src_rank: int, group: Any = None, **kwargs: Any) -> int:
        """Receive a request from ``src_rank`` into this pool and return its handle;
        see ``kvpool.distributed.recv_request``."""
        from kvpool.distributed.kv_transfer import recv_request
        return recv_request(self, src_rank, group, **kwargs)
